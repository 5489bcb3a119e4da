"""A dispatch-level watch over a forward: every ATen operation it runs, with the shapes it
reads and makes, and a failure at the first one that would make a GPU wait on the host or
the host on the GPU — a scalar read back (`.item()`, `.tolist()`, a Python `if` on a tensor),
an operator whose output size depends on data (`nonzero`, masked selects, boolean indexing),
or a tensor made from host data inside the forward (`torch.tensor(list)`, a copy from the
CPU to another device). On a CPU these cost nothing, which is why they must be looked for:
the same forward on a GPU would stall at each of them, and none of them can be captured in
a CUDA graph or compiled whole."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Reads a scalar back to the host, or sizes its output by the data.
SYNCING = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "unique",
    "_unique2",
    "unique_consecutive",
    "repeat_interleave",
    "bincount",
}
# Tensors made from host data: a Python list or scalar turned into a tensor.
FROM_HOST = {"lift_fresh", "lift_fresh_copy", "scalar_tensor"}


class HostSyncError(AssertionError):
    pass


class HostSyncCheck(TorchDispatchMode):
    """Records (operator, shapes) of every operation and raises HostSyncError at one that syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNCING or name in FROM_HOST:
            raise HostSyncError(f"{func} in the forward")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                raise HostSyncError(f"{func} with a boolean mask in the forward")
        if name in ("_to_copy", "copy_") and _crosses_from_host(func, args, kwargs):
            raise HostSyncError(f"{func} from the host in the forward")
        out = func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs, out))
        self.trace.append((str(func), tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor))))
        return out


def _crosses_from_host(func, args, kwargs) -> bool:
    """Whether a copy moves a CPU tensor to another device."""
    if func.overloadpacket.__name__ == "copy_":
        destination, source = args[0], args[1]
        return source.device.type == "cpu" and destination.device.type != "cpu"
    source, device = args[0], kwargs.get("device")
    return device is not None and source.device.type == "cpu" and torch.device(device).type != "cpu"
