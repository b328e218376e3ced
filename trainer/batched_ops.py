"""The layers whose vmapped form does not compute what the single model computes, and their replacements.

`torch.func.vmap` batches any module, but three of its rules differ from the single-model path:

1. `nn.Linear`: vmap's rule for `linear` computes the weight gradient as `(x^T g)^T`, where the single model's
   `addmm` backward computes `g^T x`: the same sum in another order, a few ulps apart for non-square weights.
   `StackedLinear` computes the batched forward and backward with `baddbmm`/`bmm` in the single model's order (a
   custom operator with a vmap rule, so it stays inside `vmap(functional_call(...))`), and each member's values are
   then those of the single model, bit for bit on a CPU. One more catch (`member_matmul`): with more than one
   intra-op thread, MKL's sgemm sums some shapes in another order than with one (on this CPU the weight gradient
   of a 10-wide output layer, `g^T x` for g [rows, 10]), and `bmm` runs each member's product on one thread, while
   the single model's `mm` uses them all. Each product's batched form is checked once against the members' single
   products (per shape and thread count, on random data); where they differ, each member's product is computed
   alone, by the single model's own call.
2. `nn.Dropout`: under vmap a random op either draws one mask for all members or fails. `MemberDropout` draws each
   member's mask from that member's own generator with the member's own rate, exactly as `F.dropout` draws it
   (`bernoulli_(1 - p)`, divided by `1 - p`), so a member sees the masks it would see alone.

3. `F.scaled_dot_product_attention`: vmap's rules for the fused attention kernels fail on CUDA (the memory-efficient
   kernel's "LSE is not correctly aligned (strideH)", seen on an H200 with torch 2.11) and have none for the CPU's
   flash kernel (vmap then loops over the members). `stacked_attention` reroutes the call, within the engine's
   vmapped forward, to a custom operator whose vmap rule folds the member dimension into the batch dimension and
   calls the fused kernel once on plain tensors: each member's rows are attended as the single model attends them.

`prepare_template` swaps the first two into a copy of a member's module; other random ops inside the model
(attention dropout, say) are left alone and make the vmapped forward fail with vmap's randomness error, which the
engine turns into the ordinary loop (never a wrong answer).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["MemberDropout", "MemberPaddedEmbedding", "StackedChain", "StackedLinear", "dropout_rates",
           "member_matmul", "member_randomness", "per_member", "prepare_template", "stacked_attention",
           "stacked_chain", "stacked_dropout"]


# ---------------------------------------------------------------------------------------------------------------------
# Matrix products, each member's as the single model computes it.

# The three products of a linear layer, batched and as the single model computes them (`addmm` and its backward):
# the forward, the input gradient g @ W, and the weight gradient g^T @ x (not (x^T @ g)^T).
_PRODUCTS: dict[str, tuple[Callable[..., Tensor], Callable[..., Tensor]]] = {
    "forward": (lambda x, w, b: torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2)),
                lambda x, w, b: torch.addmm(b, x, w.t())),
    "grad_x": (lambda g, w: torch.bmm(g, w), lambda g, w: g.mm(w)),
    "grad_w": (lambda g, x: torch.bmm(g.transpose(1, 2), x), lambda g, x: g.t().mm(x)),
}
_AGREES: dict[tuple[Any, ...], bool] = {}  # (name, shapes, dtype, threads) -> whether the batched form is exact
_PROBES = 8  # random draws per check: two summation orders agree on one draw by chance, hardly on eight


def per_member(name: str, batched: Callable[..., Tensor], single: Callable[..., Tensor], *args: Tensor) -> Tensor:
    """`batched(*args)` on stacked [K, ...] arguments, each member's slice equal, bit for bit, to what `single` gives
    on that member's slices: the batched kernel where it agrees with the single one (checked once per `name`,
    shapes, dtype and thread count, on random data drawn from a private generator, so the members' RNGs do not
    move), else `single` once per member. On other devices than a CPU the batched kernel is taken as it is (no
    bit-for-bit claim there)."""
    if args[0].device.type != "cpu":
        return batched(*args)
    k = args[0].shape[0]
    key = (name, tuple(tuple(a.shape) for a in args), args[0].dtype, torch.get_num_threads())
    agrees = _AGREES.get(key)
    if agrees is None:
        generator = torch.Generator().manual_seed(0)
        agrees = True
        for _ in range(_PROBES):
            probe = [torch.randn(a.shape, generator=generator, dtype=a.dtype) for a in args]
            together = batched(*probe)
            agrees = agrees and all(torch.equal(together[m], single(*(_own(a[m]) for a in probe))) for m in range(k))
        _AGREES[key] = agrees
    if agrees:
        return batched(*args)
    return torch.stack([single(*(_own(a[m]) for a in args)) for m in range(k)])


def _own(member: Tensor) -> Tensor:
    """A member's slice as the single model holds that tensor: in memory of its own. A slice of a stack starts
    wherever the members before it end (a 143x143 weight: 81796 bytes in, not on a 64-byte line), and a CPU matrix
    product may sum in another order for data that is not aligned as a tensor of its own is (review: a cohort's
    evaluations differed from the single model's in the last bit for hidden sizes 33 and 143)."""
    return member.clone() if member.data_ptr() % 64 else member


def member_matmul(product: str, *args: Tensor) -> Tensor:
    """`product` ("forward", "grad_x" or "grad_w") of stacked [K, ...] arguments, each member's slice equal, bit for
    bit, to the single model's call on that member's tensors (`per_member`). On a CPU a batched product runs each
    member's matrix product on one thread, while the single model's `mm` may split a product over threads in another
    summation order (MKL does for some shapes)."""
    batched, single = _PRODUCTS[product]
    return per_member(product, batched, single, *args)


# ---------------------------------------------------------------------------------------------------------------------
# Linear.

@torch.library.custom_op("trainer_batched::stacked_linear", mutates_args=())
def _stacked_linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x [K, N, in], weight [K, out, in], bias [K, out] -> [K, N, out]: `addmm(bias, x, weight.t())` per member."""
    return member_matmul("forward", x, weight, bias)


def _stacked_linear_context(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _stacked_linear_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    x, weight = ctx.saved_tensors
    # addmm's backward for one model: grad_x = g @ W, grad_W = g^T @ x, grad_b = g summed over rows.
    return member_matmul("grad_x", grad, weight), member_matmul("grad_w", grad, x), grad.sum(1)


class _StackedLinearFunction(torch.autograd.Function):
    """`_stacked_linear` as a plain autograd function, for `StackedChain`, which runs outside vmap: the same kernels
    without a custom operator's dispatch, and no input gradient where none is needed (the first layer's)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return member_matmul("forward", x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
        x, weight = ctx.saved_tensors
        grad_x = member_matmul("grad_x", grad, weight) if ctx.needs_input_grad[0] else None
        return grad_x, member_matmul("grad_w", grad, x), grad.sum(1)


torch.library.register_autograd("trainer_batched::stacked_linear", _stacked_linear_backward,
                                setup_context=_stacked_linear_context)


@torch.library.custom_op("trainer_batched::linear", mutates_args=())
def _linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return F.linear(x, weight, bias)


@torch.library.register_vmap("trainer_batched::linear")
def _linear_vmap(info: Any, in_dims: tuple[int | None, ...], x: Tensor, weight: Tensor,
                 bias: Tensor) -> tuple[Tensor, int]:
    k = info.batch_size
    x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x.expand(k, *x.shape)
    weight = weight.movedim(in_dims[1], 0) if in_dims[1] is not None else weight.expand(k, *weight.shape)
    bias = bias.movedim(in_dims[2], 0) if in_dims[2] is not None else bias.expand(k, *bias.shape)
    rows = x.reshape(k, -1, x.shape[-1])  # F.linear flattens leading dims into rows too
    out = _stacked_linear(rows.contiguous(), weight.contiguous(), bias.contiguous())
    return out.reshape(*x.shape[:-1], weight.shape[1]), 0


def _autocast_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Under autocast, the inputs cast to its dtype, as autocast casts `F.linear`'s: autocast has no rule for a custom
    operator, so without this the operator's products would be cast inside it (its output in bf16) while its backward,
    which runs outside autocast, met a bf16 gradient with the fp32 weight it saved."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


class StackedLinear(nn.Linear):
    """`nn.Linear` whose vmapped form computes each member's values as the single model does. Same parameters and
    state dict; without a bias it is plain `F.linear`."""

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return F.linear(x, self.weight)
        return _linear(*_autocast_inputs(x, self.weight, self.bias))


# ---------------------------------------------------------------------------------------------------------------------
# Attention.

@torch.library.custom_op("trainer_batched::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
               scale: float | None) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


@_attention.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                    scale: float | None) -> Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.register_vmap("trainer_batched::attention")
def _attention_vmap(info: Any, in_dims: tuple[int | None, ...], q: Tensor, k: Tensor, v: Tensor,
                    attn_mask: Tensor | None, is_causal: bool, scale: float | None) -> tuple[Tensor, int]:
    n = info.batch_size

    def stacked(t: Tensor, dim: int | None) -> Tensor:
        return t.movedim(dim, 0) if dim is not None else t.expand(n, *t.shape)

    q, k, v = stacked(q, in_dims[0]), stacked(k, in_dims[1]), stacked(v, in_dims[2])
    lead = q.shape[1:-2]  # each member's batch dimensions (batch, heads), broadcast against key and value's
    k = k.expand(n, *lead, *k.shape[-2:])
    v = v.expand(n, *lead, *v.shape[-2:])

    def folded(t: Tensor) -> Tensor:  # [K, *lead, L, E] -> [K * batch, heads, L, E], the fused kernels' layout
        return t.reshape(-1, *lead[-1:], *t.shape[-2:]).contiguous()

    if attn_mask is not None:  # broadcastable to each member's [*lead, L, S]: made whole, then folded as q is
        mask = stacked(attn_mask, in_dims[3])
        mask = mask.reshape(n, *[1] * (len(lead) + 3 - mask.dim()), *mask.shape[1:])
        attn_mask = folded(mask.expand(n, *lead, q.shape[-2], k.shape[-2]))

    out = F.scaled_dot_product_attention(folded(q), folded(k), folded(v), attn_mask=attn_mask, is_causal=is_causal,
                                         scale=scale)
    return out.reshape(n, *lead, *out.shape[-2:]), 0


class _StackedAttention(TorchFunctionMode):
    """Reroutes `F.scaled_dot_product_attention` to `_attention` (see the module's docstring). A call with dropout
    or grouped-query attention is left as it is: under vmap its random draw or its shapes make the probe fail, and
    the engine trains that model by the ordinary loop."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, mask, dropout_p, is_causal, scale, gqa = _attention_arguments(*args, **kwargs)
            if dropout_p == 0.0 and not gqa:
                return _attention(q, k, v, mask, bool(is_causal), scale)
        return func(*args, **kwargs)


def _attention_arguments(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                         enable_gqa: bool = False) -> tuple[Any, ...]:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def stacked_attention() -> contextlib.AbstractContextManager[Any]:
    """Within this block (the engine's vmapped forward), attention runs as `_attention`."""
    return _StackedAttention()


# ---------------------------------------------------------------------------------------------------------------------
# Dropout.

class _Randomness:
    """The cohort's per-member dropout, set around each training forward: `rates[k][layer]` and `generators[k]`."""

    rates: Sequence[Sequence[float]] = ()
    generators: Sequence[torch.Generator | None] = ()


_RANDOMNESS = _Randomness()


@contextmanager
def member_randomness(rates: Sequence[Sequence[float]], generators: Sequence[torch.Generator | None]) -> Iterator[None]:
    """Within this block, `MemberDropout` layer `i` of member `k` drops with `rates[k][i]`, drawing from
    `generators[k]` (None: a free slot, which draws nothing and keeps everything)."""
    _RANDOMNESS.rates, _RANDOMNESS.generators = rates, generators
    try:
        yield
    finally:
        _RANDOMNESS.rates, _RANDOMNESS.generators = (), ()


@torch.library.custom_op("trainer_batched::member_dropout", mutates_args=())
def _member_dropout(x: Tensor, layer: int) -> Tensor:
    raise RuntimeError("MemberDropout draws per member and runs only inside the batched engine's vmap")


def stacked_dropout(x: Tensor, layer: int) -> Tensor:
    """Dropout layer `layer` on a stacked [K, ...] tensor: member `k` drops with its own rate, drawing from its own
    generator (see `member_randomness`). A member whose rate is 0 draws nothing and keeps everything, as `F.dropout`
    returns its input untouched; when no member drops, `x` itself is returned."""
    drawing = [(k, rates[layer], generator)
               for k, (rates, generator) in enumerate(zip(_RANDOMNESS.rates, _RANDOMNESS.generators, strict=True))
               if generator is not None and rates[layer] != 0.0]
    if not drawing:
        return x
    noise = torch.ones_like(x)
    for k, p, generator in drawing:  # each member's own generator: one draw per dropping member, in member order
        if p == 1.0:  # F.dropout's own special case: zeros, drawing nothing (dividing by 1 - p would make NaN)
            noise[k].zero_()
            continue
        # F.dropout on a CPU: noise = empty_like(x).bernoulli_(1 - p); noise.div_(1 - p); x * noise
        noise[k].bernoulli_(1 - p, generator=generator).div_(1 - p)
    return x * noise


@torch.library.register_vmap("trainer_batched::member_dropout")
def _member_dropout_vmap(info: Any, in_dims: tuple[int | None, ...], x: Tensor, layer: int) -> tuple[Tensor, int]:
    x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x.expand(info.batch_size, *x.shape)
    out = stacked_dropout(x, layer)
    return (out.clone() if out is x else out), 0  # a custom op's output may not alias its input


class MemberDropout(nn.Module):
    """`nn.Dropout` with a rate and a generator per member (see `member_randomness`). `layer`: its index among the
    model's dropout layers, in module order."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return _member_dropout(x, self.layer) if self.training else x


# ---------------------------------------------------------------------------------------------------------------------
# The template.

def dropout_rates(model: nn.Module) -> list[float]:
    """The rates of a model's `nn.Dropout` layers, in module order."""
    return [float(m.p) for m in model.modules() if type(m) is nn.Dropout]


class MemberPaddedEmbedding(nn.Embedding):
    """`nn.Embedding` with a `padding_idx`, as vmap cannot batch it: vmap's rule folds the members' tables into one
    and offsets each member's indices by its place, so the padding row is left out of the gradient of the first
    member only, and the others train theirs. Here the lookup has no padding index, and the positions that hold it
    pass their rows on without a gradient: each member's padding row gets none, its forward is the single model's,
    and every other row's gradient sums the same terms."""

    def forward(self, input: Tensor) -> Tensor:
        out = F.embedding(input, self.weight, None, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                          self.sparse)
        assert self.padding_idx is not None  # only such modules are swapped for this one
        return torch.where(input.eq(self.padding_idx).unsqueeze(-1), out.detach(), out)


def prepare_template(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device with `StackedLinear` for `nn.Linear`, `MemberDropout` for `nn.Dropout`
    and `MemberPaddedEmbedding` for an `nn.Embedding` with a padding index (exact types only: a subclass may do
    something else). Parameter and buffer names stay as they were."""
    template = copy.deepcopy(model).to("meta")  # moving to meta unties tied parameters: tied again below
    # By the module's identity: one module under two names (a dropout layer passed to two blocks) is swapped under
    # both for one and the same module, which keeps one dropout layer number (`dropout_rates` counts it once).
    swapped: dict[int, nn.Module] = {}
    layer = 0
    for qualified, child in list(template.named_modules(remove_duplicate=False)):  # module order, as `dropout_rates`
        if type(child) is nn.Embedding and child.padding_idx is not None:
            child.__class__ = MemberPaddedEmbedding  # the same module and parameter, its forward replaced
            continue
        if not qualified or type(child) not in (nn.Linear, nn.Dropout):  # the root has no parent to swap it in
            continue
        if id(child) not in swapped:
            if type(child) is nn.Linear:
                swapped[id(child)] = StackedLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                                   device="meta")
                swapped[id(child)].weight, swapped[id(child)].bias = child.weight, child.bias  # the same (tied) ones
            else:
                swapped[id(child)] = MemberDropout(layer)
                layer += 1
        parent_name, _, name = qualified.rpartition(".")
        setattr(template.get_submodule(parent_name), name, swapped[id(child)])
    first: dict[int, str] = {}  # a parameter's first name, by the parameter's identity in `model`
    for qualified, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            first[id(p)] = qualified
            continue
        owner, _, name = qualified.rpartition(".")  # a tied name (a language model's head and embedding, say)
        setattr(template.get_submodule(owner), name, template.get_parameter(first[id(p)]))
    return template


# ---------------------------------------------------------------------------------------------------------------------
# The fast path: a chain of layers run on the stacked tensors directly.

# Layers that act on each element alone, so that on a stacked tensor each member's elements get what they get alone.
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Identity)


@dataclass(frozen=True)
class StackedChain:
    """A model that is a plain chain of `nn.Linear` (with bias), `nn.Dropout` and element-wise activations (an MLP),
    run on stacked [K, ...] tensors without vmap: the same stacked kernels as vmap's path (`_stacked_linear`,
    `stacked_dropout`, the activation on the whole stack), without vmap's and the custom operators' per-call cost,
    which dominates a small model's step. `steps`: ("linear", module name), ("dropout", layer index) or
    ("elementwise", module)."""

    steps: tuple[tuple[str, Any], ...]

    def __call__(self, params: Mapping[str, Tensor], x: Tensor, training: bool, shared: bool = False) -> Tensor:
        """x: [K, ...] (a batch per member), or with `shared` one batch for every member (evaluation)."""
        k = next(iter(params.values())).shape[0]
        if shared:  # one copy each, as vmap's linear rule makes for an input without a member dimension
            x = x.expand(k, *x.shape).contiguous()
        for kind, value in self.steps:
            if kind == "linear":
                weight, bias = params[f"{value}.weight"], params[f"{value}.bias"]
                rows = x.reshape(k, -1, x.shape[-1]).contiguous()  # F.linear flattens leading dims into rows too
                rows, weight, bias = _autocast_inputs(rows, weight, bias)
                x = _StackedLinearFunction.apply(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[1])
            elif kind == "dropout":
                x = stacked_dropout(x, value) if training else x
            else:
                x = value(x)
        return x


def stacked_chain(model: nn.Module) -> StackedChain | None:
    """`model` as a `StackedChain` when its traced graph (`torch.fx`) is one input through a chain of such layers and
    nothing else; None otherwise (the engine then runs `vmap`). The chain is read from the trace, not from the
    module's type, so a model whose forward does anything besides calling those layers in a row is never taken."""
    if list(model.buffers()):
        return None
    try:  # a copy: tracing runs forward with proxies, and one that assigns to the module would leave them there
        graph = torch.fx.symbolic_trace(copy.deepcopy(model).train()).graph
        # A trace fixes every Python branch: one on `self.training` (or on anything else that differs between the
        # two modes) would run the training graph in evaluations too. Such a forward runs under vmap, which calls it.
        evaluating = torch.fx.symbolic_trace(copy.deepcopy(model).eval()).graph
    except Exception:  # noqa: BLE001 - a model fx cannot trace runs under vmap
        return None
    if _shape(graph) != _shape(evaluating):
        return None
    modules = dict(model.named_modules())
    layers = {name: i for i, name in enumerate(n for n, m in model.named_modules() if type(m) is nn.Dropout)}
    params = dict(model.named_parameters())
    used: set[str] = set()
    steps: list[tuple[str, Any]] = []
    previous = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is not None:
                return None
        elif node.op == "call_module" and node.args == (previous,) and not node.kwargs and previous is not None:
            module = modules[str(node.target)]
            if type(module) is nn.Linear and module.bias is not None:
                names = {f"{node.target}.weight", f"{node.target}.bias"}
                if not names <= params.keys() or params[f"{node.target}.weight"] is not module.weight:
                    return None  # a shared (tied) weight is named once: let vmap handle it
                used |= names
                steps.append(("linear", str(node.target)))
            elif type(module) is nn.Dropout:
                steps.append(("dropout", layers[str(node.target)]))
            elif type(module) in _ELEMENTWISE and not getattr(module, "inplace", False):
                steps.append(("elementwise", module))
            else:
                return None
        elif node.op == "output" and node.args == (previous,) and previous is not None and previous.op != "placeholder":
            return StackedChain(tuple(steps)) if used == params.keys() else None
        else:
            return None
        previous = node
    return None


def _shape(graph: torch.fx.Graph) -> list[tuple[str, str, str, str]]:
    return [(node.op, str(node.target), repr(node.args), repr(node.kwargs)) for node in graph.nodes]
