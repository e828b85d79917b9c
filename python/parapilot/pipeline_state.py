"""The training state of pipeline blocks: collected, installed, serialised and saved.

A block's state is what a rank needs to take the block over exactly: its parameters' values, its
buffers' values and the optimizer state of each of its parameters (Adam's step, exp_avg and
exp_avg_sq, SGD's momentum_buffer, ...), as a dict

    {"params": [Tensor, ...], "buffers": [Tensor, ...], "optim": [{key: value}, ...]}

in the block's named_parameters() / named_buffers() order, one optimizer dict per parameter ({}
for a parameter the optimizer has not stepped yet). A live block move (pipeline_move.py) and the
checkpoint of a restart (save_blocks / load_blocks) both carry exactly this, so the two paths
install the same values bit for bit.

collect() clones nothing the caller may change later: the tensors are detached clones.
install() copies into the block's own tensors (materialising a block kept on the meta device
first) and returns the optimizer dicts for the caller's new optimizer (attach_optim_state).
Errors: BlockStateError (a ValueError) naming the block and what does not match.
"""

from __future__ import annotations

import io
from typing import Any, Dict, Iterable, List, Mapping, Sequence

import torch

__all__ = ["BlockStateError", "collect", "install", "attach_optim_state", "to_bytes",
           "from_bytes", "save_blocks", "load_blocks", "free_block"]


class BlockStateError(ValueError):
    """A block state that does not fit the block it is installed into."""


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def collect(block: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, list]:
    """The state of `block` (its parameters must be in `optimizer` or have no state there)."""
    params = [p for _, p in block.named_parameters()]
    return {"params": [p.detach().clone() for p in params],
            "buffers": [b.detach().clone() for _, b in block.named_buffers()],
            "optim": [{k: _clone(v) for k, v in optimizer.state.get(p, {}).items()}
                      for p in params]}


def install(block: torch.nn.Module, state: Mapping[str, list], index: int,
            device: torch.device) -> List[dict]:
    """Writes `state` into `block` (on `device`; a block on the meta device is materialised) and
    returns its per-parameter optimizer dicts, in parameter order."""
    params = [p for _, p in block.named_parameters()]
    buffers = [b for _, b in block.named_buffers()]
    if len(state["params"]) != len(params) or len(state["buffers"]) != len(buffers):
        raise BlockStateError(
            f"block {index}: state has {len(state['params'])} parameters and "
            f"{len(state['buffers'])} buffers, the block {len(params)} and {len(buffers)}")
    if any(p.is_meta for p in params) or any(b.is_meta for b in buffers) or \
            any(p.device != device for p in params):
        block.to_empty(device=device)
        params = [p for _, p in block.named_parameters()]
        buffers = [b for _, b in block.named_buffers()]
    with torch.no_grad():
        for i, (dst, src) in enumerate(zip(params + buffers, state["params"] + state["buffers"])):
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise BlockStateError(f"block {index}: tensor {i} is {tuple(src.shape)} "
                                      f"{src.dtype} in the state, {tuple(dst.shape)} {dst.dtype} "
                                      "in the block")
            dst.copy_(src)
    for p in params:
        p.grad = None
    return [dict(d) for d in state["optim"]]


def attach_optim_state(optimizer: torch.optim.Optimizer,
                       params: Sequence[torch.nn.Parameter],
                       states: Sequence[Mapping[str, Any]]) -> None:
    """Gives each of `params` (parameters of `optimizer`) its optimizer state, as collected."""
    for p, st in zip(params, states):
        if st:
            optimizer.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor)
                                      and v.dim() > 0 else v) for k, v in st.items()}


def free_block(block: torch.nn.Module) -> None:
    """Releases a block's tensors (moved to the meta device; install() brings it back)."""
    for p in block.parameters():
        p.grad = None
    block.to("meta")


def to_bytes(states: Mapping[int, Mapping[str, list]]) -> torch.Tensor:
    """{block: state} as a uint8 tensor (torch.save; exact)."""
    buf = io.BytesIO()
    torch.save({int(k): v for k, v in states.items()}, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Dict[int, Dict[str, list]]:
    """The inverse of to_bytes."""
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def save_blocks(path: str, states: Mapping[int, Mapping[str, list]], step: int) -> None:
    """Writes a rank's blocks to `path` (torch.save of {"step", "blocks"})."""
    torch.save({"step": int(step), "blocks": {int(k): v for k, v in states.items()}}, path)


def load_blocks(paths: Iterable[str]) -> Dict[str, Any]:
    """Reads the files save_blocks wrote (every rank's): {"step", "blocks": {block: state}}.
    BlockStateError when they disagree on the step or hold a block twice."""
    blocks: Dict[int, Dict[str, list]] = {}
    step = None
    for path in paths:
        d = torch.load(path, weights_only=True)
        if step is not None and d["step"] != step:
            raise BlockStateError(f"{path} was saved at step {d['step']}, another at {step}")
        step = d["step"]
        for k, v in d["blocks"].items():
            if k in blocks:
                raise BlockStateError(f"block {k} is saved twice ({path})")
            blocks[k] = v
    return {"step": step, "blocks": blocks}
