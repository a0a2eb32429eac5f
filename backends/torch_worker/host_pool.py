"""The host tier's memory (docs/tiers.md): one KV tensor per KV layout in host memory, the shape
of the GPU pool's (`PagePool.kv`), pinned under CUDA, and the two page copies `HostTier` makes
through it. A copy moves whole pages of every layer, K and V, in one index_select/index_copy_."""

from __future__ import annotations

import torch

from backends.cache.host import HostTier
from backends.cache.pool import RemovedCallback
from backends.cache.radix import RadixCache, StoredCallback
from backends.torch_worker.paging import KVLayout, PagePool

PAGE_DIM = 2  # kv[k_or_v, layer, page, offset, head, dim]


class HostPagePool:
    """`num_pages` host pages of `gpu`'s layout. Copies to a CUDA pool are asynchronous (from
    pinned memory, on the current stream, so the forward that follows reads them in order);
    `wait` holds the host until they are done, before their staging buffers go."""

    def __init__(self, gpu: PagePool, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("a host pool needs at least one page")
        self.gpu = gpu
        self.layout: KVLayout = gpu.layout
        self.num_pages = num_pages
        shape = list(gpu.kv.shape)
        shape[PAGE_DIM] = num_pages
        self.cuda = gpu.kv.device.type == "cuda"
        self.kv = torch.zeros(shape, dtype=gpu.kv.dtype, pin_memory=self.cuda)
        self._staged: list[torch.Tensor] = []  # pinned sources of copies still in flight
        self.copied_out_pages = self.copied_in_pages = 0

    def copy_out(self, gpu_pages: list[int], host_pages: list[int]) -> None:
        """The KV of `gpu_pages` into `host_pages` (a demotion: the GPU pages are freed after,
        so this copy completes before it returns)."""
        device = self.gpu.kv.device
        src = torch.tensor(gpu_pages, dtype=torch.long, device=device)
        pages = self.gpu.kv.index_select(PAGE_DIM, src)
        dst = torch.tensor(host_pages, dtype=torch.long)
        self.kv.index_copy_(PAGE_DIM, dst, pages.cpu())
        self.copied_out_pages += len(gpu_pages)

    def copy_in(self, host_pages: list[int], gpu_pages: list[int]) -> None:
        """The KV of `host_pages` into `gpu_pages` (a promotion, before the prefill reads them)."""
        src = torch.tensor(host_pages, dtype=torch.long)
        device = self.gpu.kv.device
        if self.cuda:  # gathered straight into a pinned buffer, kept until `wait`
            shape = list(self.kv.shape)
            shape[PAGE_DIM] = len(host_pages)
            pages = torch.empty(shape, dtype=self.kv.dtype, pin_memory=True)
            torch.index_select(self.kv, PAGE_DIM, src, out=pages)
            self._staged.append(pages)
        else:
            pages = self.kv.index_select(PAGE_DIM, src)
        dst = torch.tensor(gpu_pages, dtype=torch.long, device=device)
        self.gpu.kv.index_copy_(PAGE_DIM, dst, pages.to(device, non_blocking=True))
        self.copied_in_pages += len(host_pages)

    def wait(self) -> None:
        """Every promotion copied: the staging buffers may go."""
        if self._staged:
            torch.cuda.current_stream(self.gpu.kv.device).synchronize()
            self._staged.clear()


def make_host_tier(
    gpu: PagePool,
    cache: RadixCache,
    capacity_tokens: int,
    on_stored: StoredCallback,
    on_removed: RemovedCallback,
) -> tuple[HostTier, HostPagePool]:
    """A paged host tier of `capacity_tokens` under `cache` (which keeps tokens), its KV in a
    host pool of `gpu`'s layout."""
    page_size = gpu.layout.page_size
    memory = HostPagePool(gpu, capacity_tokens // page_size)
    tier = HostTier(
        memory.num_pages * page_size,
        page_size,
        page_ids=list(range(memory.num_pages - 1, -1, -1)),
        keep_tokens=True,
        on_stored=on_stored,
        on_removed=on_removed,
    )
    tier.attach(cache, memory.copy_out, memory.copy_in)
    return tier, memory
