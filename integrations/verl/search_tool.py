"""The `search` tool of example_search_mpo.yaml, for verl's `function_tool_path`.

verl executes this file once per agent-loop worker and registers every `@function_tool`; the
OpenAI schema comes from the signature and the docstring below.
"""
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))   # search_task.py, next to this file
from search_task import search_documents  # noqa: E402
from verl.tools.function_tool import function_tool  # noqa: E402


@function_tool
def search(query: str) -> str:
    """Search the knowledge base and return the top documents.

    Args:
        query: The name of one person, organisation, city or region.
    """
    return search_documents(query)
