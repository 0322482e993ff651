"""Ready-made tools (``agentrl.tool.Tool`` subclasses) for environments to offer the model."""

from tools.calculator import Calculator, calculator, evaluate

__all__ = ["Calculator", "calculator", "evaluate"]
