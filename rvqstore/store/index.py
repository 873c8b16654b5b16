"""The store's index is the store itself: one listing gives every block (namespace, parent, key,
token count, size, write time) and every use marker, so the index survives restarts and is shared by
every process and machine that opens the store, with nothing to keep consistent beside the objects.

From a listing this module computes the tree of blocks, sizes (``du``), and the LRU eviction plan
(``gc``): a block's last use is the latest of its own write, its use marker, and its descendants'
(a lookup that ends at a block has used all its ancestors), and blocks go oldest-use first, deepest
first on ties, so a parent never goes before its children. Orphans (a parent that is gone) are
unreachable and go first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .backend import Backend, ObjectInfo
from .keys import BlockName, parse_block_path


@dataclass
class BlockEntry:
    name: BlockName
    size: int
    written: float
    last_used: float = 0.0
    depth: int = -1  # -1: not reachable from its namespace root (an orphan)
    children: list["BlockEntry"] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.name.path


@dataclass
class StoreIndex:
    blocks: dict[str, BlockEntry]  # by path
    markers: dict[str, ObjectInfo]  # use markers by path
    namespaces: dict[str, int]  # ns -> bytes of its namespace.json
    other: list[ObjectInfo]  # anything else under the root (not ours, or temporaries)

    @property
    def block_bytes(self) -> int:
        return sum(b.size for b in self.blocks.values())

    @property
    def total_bytes(self) -> int:
        return (self.block_bytes + sum(m.size for m in self.markers.values()) + sum(self.namespaces.values()))

    def by_namespace(self) -> dict[str, list[BlockEntry]]:
        out: dict[str, list[BlockEntry]] = {}
        for b in self.blocks.values():
            out.setdefault(b.name.ns, []).append(b)
        return out


def scan(backend: Backend, ns: str | None = None) -> StoreIndex:
    """List the store (or one namespace) and link blocks into trees with their last use."""
    objs = backend.list(f"{ns}/" if ns else "")
    blocks: dict[str, BlockEntry] = {}
    markers: dict[str, ObjectInfo] = {}
    namespaces: dict[str, int] = {}
    other: list[ObjectInfo] = []
    for o in objs:
        name = parse_block_path(o.path)
        if name is not None:
            blocks[o.path] = BlockEntry(name, o.size, o.mtime, o.mtime)
            continue
        parts = o.path.split("/")
        if len(parts) == 3 and parts[1] == "used":
            markers[o.path] = o
        elif len(parts) == 2 and parts[1] == "namespace.json":
            namespaces[parts[0]] = o.size
        else:
            other.append(o)
    by_key = {(b.name.ns, b.name.key): b for b in blocks.values()}
    for b in blocks.values():
        m = markers.get(f"{b.name.ns}/used/{b.name.key}")
        if m is not None:
            b.last_used = max(b.last_used, m.mtime)
        parent = by_key.get((b.name.ns, b.name.parent))
        if parent is not None:
            parent.children.append(b)
    # depths from each namespace root, and last use propagated up from descendants
    roots = [b for b in blocks.values() if b.name.parent == b.name.ns]
    stack = [(r, 0) for r in roots]
    order = []
    while stack:
        b, d = stack.pop()
        b.depth = d
        order.append(b)
        stack.extend((c, d + 1) for c in b.children)
    for b in reversed(order):  # children before parents
        for c in b.children:
            b.last_used = max(b.last_used, c.last_used)
    return StoreIndex(blocks, markers, namespaces, other)


@dataclass
class GCPlan:
    evict: list[BlockEntry]
    orphans: list[BlockEntry]
    stale_markers: list[str]
    keep_bytes: int
    free_bytes: int


def plan_gc(index: StoreIndex, max_bytes: int | None) -> GCPlan:
    """Orphans always; then least recently used blocks until the blocks fit ``max_bytes``."""
    orphans = [b for b in index.blocks.values() if b.depth < 0]
    live = [b for b in index.blocks.values() if b.depth >= 0]
    total = sum(b.size for b in live)
    evict = []
    if max_bytes is not None and total > max_bytes:
        for b in sorted(live, key=lambda b: (b.last_used, -b.depth)):
            if total <= max_bytes:
                break
            evict.append(b)
            total -= b.size
    gone = {(b.name.ns, b.name.key) for b in orphans + evict}
    live_keys = {(b.name.ns, b.name.key) for b in index.blocks.values()} - gone
    stale = [p for p in index.markers if (p.split("/")[0], p.split("/")[2]) not in live_keys]
    return GCPlan(evict, orphans, stale, total, sum(b.size for b in orphans + evict))


def run_gc(backend: Backend, max_bytes: int | None, *, temp_age_s: float = 3600.0) -> GCPlan:
    """Carry out :func:`plan_gc` (deepest blocks first, so a concurrent reader never finds a child
    without its parent), then remove use markers of removed blocks and writers' temporary files older
    than ``temp_age_s`` (local stores)."""
    index = scan(backend)
    plan = plan_gc(index, max_bytes)
    for b in sorted(plan.orphans + plan.evict, key=lambda b: -b.depth if b.depth >= 0 else -10**9):
        backend.delete(b.path)
    for p in plan.stale_markers:
        backend.delete(p)
    temps = getattr(backend, "list_temporaries", None)
    if temps is not None:
        now = time.time()
        for t in temps():
            if now - t.mtime > temp_age_s:
                backend.delete(t.path)
    return plan
