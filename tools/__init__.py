"""Ready-made tools (``agentrl.tool.Tool`` subclasses) for environments to offer the model."""

from tools.bash import BashTool, bash
from tools.calculator import Calculator, calculator, evaluate
from tools.files import ReadFileTool, WriteFileTool, read_file, write_file
from tools.python import PythonTool, python
from tools.search import Corpus, Document, SearchTool

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
