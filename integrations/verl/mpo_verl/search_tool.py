"""The `search` tool of example_search_mpo.yaml, for verl's `function_tool_path`.

verl executes this file (by path: the example config's `${mpo_verl.file:search_tool.py}`) once
per agent-loop worker and registers every `@function_tool`; the OpenAI schema comes from the
signature and the docstring below.
"""
from verl.tools.function_tool import function_tool

from mpo_verl.search_task import search_documents


@function_tool
def search(query: str) -> str:
    """Search the knowledge base and return the top documents.

    Args:
        query: The name of one person, organisation, city or region.
    """
    return search_documents(query)
