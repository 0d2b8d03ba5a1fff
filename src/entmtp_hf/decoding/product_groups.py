"""A compiled graph's int8 products of one input, grouped into one call.

A decoder layer multiplies one normalised input by three weights (q, k and v) and another by two
(gate and up). On a CPU each of the package's product calls costs a few microseconds around its
work (the graph's Python wrapper, the dispatcher, the threads' start and join), and a one-token
forward of the demo model makes 210 of them. This pass, run by inductor on each post-grad graph
(``post_grad_custom_post_pass``), replaces the ``entmtp_hf_cpu::gemv_int8`` calls that read the same
input with one ``entmtp_hf_cpu::gemv_int8_group`` call: the input is held once and the columns of all
the weights are split over the threads together. Each output is exactly what its own call gives (an
output element depends only on its row of the input and its weight row), so grouping changes no
value: compiled EntMTP stays equal to compiled plain decoding, which runs the same graphs.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files


def _operators() -> tuple[Any, Any] | None:
    """The single and the grouped int8 product operators, or None before the extension is loaded."""
    try:
        ops = torch.ops.entmtp_hf_cpu
        return ops.gemv_int8.default, ops.gemv_int8_group.default
    except (AttributeError, RuntimeError):
        return None


def _before(arg: Any, node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
    return not isinstance(arg, torch.fx.Node) or order[arg] < order[node]


def group_products(graph: torch.fx.Graph) -> int:
    """Group ``graph``'s int8 products of one input in place; returns how many calls it removed."""
    found = _operators()
    if found is None:
        return 0
    single, grouped = found
    order = {node: i for i, node in enumerate(graph.nodes)}
    by_input: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is single and len(node.args) == 4 and not node.kwargs:
            by_input[node.args[0]].append(node)
    removed = 0
    for x, nodes in by_input.items():
        first = nodes[0]
        # the group call stands where the first product stood: every weight it reads must exist there
        ready = [n for n in nodes if all(_before(a, first, order) for a in n.args[1:])]
        if len(ready) < 2 or any("val" not in n.meta for n in ready):
            continue
        with graph.inserting_before(first):  # all new nodes first: the products are erased after
            group = graph.call_function(
                grouped, (x, [n.args[1] for n in ready], [n.args[2] for n in ready], [n.args[3] for n in ready])
            )
            group.meta["val"] = [n.meta["val"] for n in ready]
            items = [graph.call_function(operator.getitem, (group, i)) for i in range(len(ready))]
        for item, node in zip(items, ready):
            item.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(item)
            graph.erase_node(node)
        removed += len(ready) - 1
    return removed


class ProductGroups(CustomGraphPass):
    """:func:`group_products` as inductor's custom post-grad pass; its ``uuid`` (this file's hash) is
    part of inductor's cache keys and of the saved graphs' names, so a changed pass compiles anew."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        group_products(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))

    def __repr__(self) -> str:  # stable across processes: part of the saved graphs' keys
        return f"ProductGroups({self.uuid().hex()[:16]})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProductGroups)

    def __hash__(self) -> int:
        return hash(ProductGroups)
