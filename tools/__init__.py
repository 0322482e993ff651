"""Ready-made tools (``agentrl.tool.Tool`` subclasses) for environments to offer the model.

Installed as ``agentrl.tools`` from the repository's top-level ``tools/`` folder.
"""

from agentrl.tools.bash import BashTool, bash
from agentrl.tools.calculator import Calculator, calculator, evaluate
from agentrl.tools.files import ReadFileTool, WriteFileTool, read_file, write_file
from agentrl.tools.python import PythonTool, python
from agentrl.tools.search import Corpus, Document, SearchTool

__all__ = [
    "BashTool",
    "Calculator",
    "Corpus",
    "Document",
    "PythonTool",
    "ReadFileTool",
    "SearchTool",
    "WriteFileTool",
    "bash",
    "calculator",
    "evaluate",
    "python",
    "read_file",
    "write_file",
]
