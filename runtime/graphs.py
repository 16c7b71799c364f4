"""The decoder layers of a training step replayed as two CUDA graphs (`--cuda-graphs`).

A small-batch step launches a few thousand kernels (every layer's Functions, forward and backward),
and the host's launch time, not the GPU, then sets the step time. Here the whole stack of decoder
layers is captured once per input shape: one graph for its forward, one for its backward (the LoRA
parameters' gradients). A step then costs two replays plus what stays eager around them (embedding,
RoPE tables, the loss, the optimizer).

What a capture holds fixed, and so what the model refuses to graph (it runs those eagerly):
- the shape: one capture per (batch, sequence length, mask or not); the trainer pads the sequence
  length to a bucket (`bucket_length`) so that a run meets a handful of shapes;
- every input besides the hidden states, the RoPE tables and the attention mask (copied in before
  each replay): frozen weights, LoRA parameters (updated in place by the optimizer: same address)
  and the recipe (a new recipe drops the captures);
- host work per call: LoRA dropout draws its mask's seed on the host (a replay would repeat it), and
  the torch kernels (`--kernels torch`, and the stochastically rounded copies on every backend) copy
  constants from the host, which a capture cannot hold; models with any of these run eagerly.

All captures of a model share one memory pool and one set of input / output buffers
(`GraphBuffers`). That is safe because a capture's forward and backward always run back to back,
and a replay's outputs are copied out before anything else runs: nothing another shape's replay
writes is read across them. So a new shape costs its capture time, not memory.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from pact.formats.families import PROJECTIONS

# padded sequence lengths: powers of two from 64, and the run's --max-len (the last bucket)
MIN_BUCKET = 64
# --cuda-graphs auto: graphed steps where a micro-batch's work per decoder layer is small enough that the
# host's launches set the pace: tokens (--batch-size x --max-len) x a layer's frozen weights at most this.
# H200, Llama-3.2-1B shapes (61M weights a layer): 2 x 1024 tokens (1.2e11) 71.5 -> 34.6 ms a step, 6 x 1024
# (3.7e11) 87.8 -> 81.5 ms (131.8 -> 82.3 on a slower host), 16 x 1024 (1e12) 198.1 -> 199.9 ms, with +13-17%
# memory held; SmolLM2-135M (3.5M a layer) at 8 x 128 142.4 -> 17.4 ms (BENCHMARKS.md "CUDA graphs")
GRAPH_WORK = 4e11


def layer_weights(artifact) -> int:
    """The most frozen weights (N x K summed over its projections) of any decoder layer of ``artifact``'s
    language model (NVFP4 or kept bf16 alike)."""
    per: dict[int, int] = {}
    for e in artifact.meta["tensors"].values():
        if e["role"] in PROJECTIONS and e.get("layer") is not None:
            per[e["layer"]] = per.get(e["layer"], 0) + math.prod(e["shape"])
    return max(per.values(), default=0)


def use_graphs(setting: str, tokens: int, weights: int) -> bool | str:
    """PactModel's ``cuda_graphs`` for pact-train's --cuda-graphs ``setting``, micro-batches of at most
    ``tokens`` tokens and ``weights`` frozen weights a layer: True (on: refused where graphs cannot
    run), False, or "auto" (on where they can run)."""
    if setting == "auto":
        return "auto" if tokens * weights <= GRAPH_WORK else False
    return setting == "on"


def bucket_length(length: int, max_len: int) -> int:
    """The padded sequence length a graphed step runs at: the next power of two >= ``length`` (at
    least MIN_BUCKET), never above ``max_len`` (nor below ``length``)."""
    b = MIN_BUCKET
    while b < length:
        b *= 2
    return max(length, min(b, max_len))


@contextlib.contextmanager
def _aliased(adapters, params: list[torch.Tensor]):
    """Within: every adapter reads a fresh leaf sharing its parameter's storage (yielded in ``params``'
    order). A capture's autograd graph then ends at new AccumulateGrad nodes made on the capture
    stream: a parameter's own node may outlive an earlier step (a loss still referenced) on the
    default stream, and the backward capture would wait on that stream, which invalidates it."""
    alias = {id(p): p.detach().requires_grad_(True) for p in params}
    kept = [(lo, lo.A, lo.B) for lo in adapters]
    for lo in adapters:
        lo.A, lo.B = alias[id(lo.A)], alias[id(lo.B)]
    try:
        yield [alias[id(p)] for p in params]
    finally:
        for lo, A, B in kept:
            lo.A, lo.B = A, B


class GraphBuffers:
    """What every capture of a model reads and writes outside its pool, shared by all of them: the
    stack's input, its output, the output's gradient (``capacity`` tokens each; a capture uses the
    first B * S rows) and one gradient per LoRA parameter. Replays run one shape at a time and each
    copies its results out at once, so sharing costs nothing, and a new shape adds no live memory:
    whatever a capture makes lives in the pool, freed there once its backward is captured."""

    def __init__(self, capacity: int, x: torch.Tensor, params: list[torch.Tensor]):
        self.capacity = capacity
        self.x = torch.empty((capacity, x.shape[1]), dtype=x.dtype, device=x.device)
        self.out = torch.empty_like(self.x)
        self.gout = torch.empty_like(self.x)
        self.grads = [torch.zeros_like(p) for p in params]
        self.calls = 0  # graphed forwards so far: a backward must follow its own forward, nothing between


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream per device that CUDA-graph warm-ups run on (the layer captures here, the
    GPTQ sweep's column graphs). cuBLAS keeps a workspace for each (handle, stream) it has run on for
    the process's life (64 MiB on an H200): a new stream per captured shape held that much more memory
    per shape."""
    return _side_stream(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


class LayerGraphs:
    """One shape's captured forward and backward of ``run`` (the eager decoder stack, reading the
    LoRA parameters through ``adapters``), its inputs and outputs in ``bufs``."""

    def __init__(self, run, adapters, params: list[torch.Tensor], bufs: GraphBuffers, x: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, pool, warmup: int = 2):
        self.params, self.bufs = params, bufs
        with _aliased(adapters, params) as leaves:
            self._capture(run, leaves, x, cos, sin, mask, pool, warmup)

    def _capture(self, run, params, x, cos, sin, mask, pool, warmup):
        T = x.shape[0]
        self.x = self.bufs.x[:T]
        self.x.copy_(x)
        self.cos, self.sin = cos.detach().clone(), sin.detach().clone()
        self.mask = None if mask is None else mask.detach().clone()

        def fwd():
            return run(self.x, self.cos, self.sin, self.mask)

        side = side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compilation and tuning, cuBLAS and cuDNN plans
            for _ in range(warmup):
                out = fwd()
                torch.autograd.grad(out, params, torch.zeros_like(out), allow_unused=True)
                shape = out.shape
                del out
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's cached blocks back to the device for the graphs' pool
        self.out, self.gout = self.bufs.out[:T].view(shape), self.bufs.gout[:T].view(shape)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd, pool=pool):
            out = fwd()
            self.out.copy_(out)
        with torch.cuda.graph(self.bwd, pool=pool):
            grads = torch.autograd.grad(out, params, self.gout, allow_unused=True)
            for buf, g in zip(self.bufs.grads, grads):
                if g is not None:
                    buf.copy_(g)
        self.used = [g is not None for g in grads]


class GraphedLayersFn(torch.autograd.Function):
    """The decoder stack by replay: forward copies the inputs in and replays the forward graph;
    backward copies the output's gradient in, replays the backward graph and hands autograd the
    parameters' gradients (copies: the shared buffers are rewritten by the next replay)."""

    @staticmethod
    def forward(ctx, x, cos, sin, mask, graphs: LayerGraphs, *params):
        graphs.x.copy_(x)
        graphs.cos.copy_(cos)
        graphs.sin.copy_(sin)
        if mask is not None:
            graphs.mask.copy_(mask)
        graphs.fwd.replay()
        graphs.bufs.calls += 1
        ctx.graphs, ctx.call = graphs, graphs.bufs.calls
        return graphs.out.clone()

    @staticmethod
    def backward(ctx, dout):
        g = ctx.graphs
        if g.bufs.calls != ctx.call:  # another graphed forward rewrote what this backward reads
            raise RuntimeError("--cuda-graphs: a graphed forward ran between this step's forward and backward; "
                               "run each forward's backward before the next forward, or use --cuda-graphs off")
        g.gout.copy_(dout)
        g.bwd.replay()
        return (None, None, None, None, None,
                *(buf.clone() if used else None for buf, used in zip(g.bufs.grads, g.used)))


def settings_refusal(device: str, dropout: float, kernels: str | None) -> str | None:
    """Why training steps with these settings cannot be graphed (None: these do not prevent it);
    pact-train checks them before anything loads, graphable() on the built model."""
    if not device.startswith("cuda"):
        return "not on a CUDA device"
    if dropout > 0:
        return "LoRA dropout draws a new mask every call"
    if kernels == "torch":
        return "the torch kernels copy constants from the host at every call (--kernels triton can be graphed)"
    return None


def graphable(model) -> str | None:
    """Why ``model``'s training steps cannot be graphed (None: they can)."""
    why = settings_refusal(model.device.type, max((lo.dropout for lo in model.adapters.values()), default=0.0),
                           model.kernels)
    if why:
        return why
    if any(getattr(model.recipe, s).saved == "nvfp4-sr" for s in ("qkv", "o", "gate_up", "down")):
        return "stochastically rounded copies are made by torch code that copies constants from the host"
    if not model.lora_params:
        return "no LoRA parameters"
    return None
