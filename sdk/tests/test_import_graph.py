"""The SDK's modules import each other without a circle (issue 18: the ``client <->
episode`` circle). Every import that runs counts, deferred ones inside functions too;
imports under ``TYPE_CHECKING`` (annotations only, never executed) do not. Modules that
need a ``Sandbox`` from a client they were given ask that client for it
(``client._sandbox(data)``) instead of importing the client's module back."""

from __future__ import annotations

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    found = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                found.append((module, *back))
    return found


def test_no_sdk_module_imports_one_that_imports_it_back():
    graph = grimp.build_graph("hedgerow", exclude_type_checking_imports=True, cache_dir=None)
    assert "hedgerow.episode" in graph.modules and "hedgerow.client" in graph.modules
    assert _cycles(graph) == []


def test_the_check_sees_a_circle_when_there_is_one():
    # The check itself can fail: an episode importing the client back is a circle.
    graph = grimp.build_graph("hedgerow", exclude_type_checking_imports=True, cache_dir=None)
    graph.add_import(importer="hedgerow.episode", imported="hedgerow.client")
    assert ("hedgerow.client", "hedgerow.episode", "hedgerow.client") in _cycles(graph)
