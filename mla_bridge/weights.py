"""kv_b_proj prepared once per layer, at load time: the layout the up-projection of mla_prefill reads.

A DeepSeek checkpoint stores ``kv_b_proj.weight`` as ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` (per
head: the k_nope rows, then the v rows). The prefill up-projection wants, for each key token's 576-wide latent row
(``kv_c ++ k_pe``), ``k = [k_nope | k_pe]`` (192 per head, contiguous, what the attention kernel reads) and ``v``
(128 per head). Rearranging the weight for that costs a copy of the weight (the identity layout's, with zero padding:
about 5% of a DeepSeek-V2-Lite layer's time on the H200, docs/results.md):
:func:`prepare_kv_b_proj` does it once and the returned :class:`PreparedKVBProj` is reused by every batch.
``mla_prefill`` still accepts the raw weight: the fused kernel of :mod:`mla_bridge.kernels.up_project` reads it in
place (:data:`CHECKPOINT_LAYOUT`, no copy), and a pass that takes the separate path (cuBLAS) rearranges it first, once
per call (the slower form: a copy of the weight per call and layer where such a pass runs).

Two layouts, chosen in one place (:data:`DEFAULT_LAYOUT`, or ``layout=`` per call of :func:`prepare_kv_b_proj`):

* ``"identity"``: ONE GEMM ``latent [N, 576] @ W.T`` with ``W [H * 320, 576]`` holding per head the k_nope rows
  ``[W_nope | 0]``, an identity block ``[0 | I]`` that copies k_pe exactly (one non-zero product per output,
  accumulated in float32) and the v rows ``[W_v | 0]``; the output viewed ``[N, H, 320]`` is ``[k (192) | v (128)]``
  per head. One launch, 40% more GEMM FLOPs than the bare up-projection (320 x 576 against 256 x 512 per head).
* ``"split"`` (the default): a buffer ``[N, H, 320]`` laid out per head as ``[v (128) | k_nope (128) | k_pe (64)]``;
  batched GEMMs (``torch.bmm`` over heads, the latent's first ``kv_lora_rank`` columns broadcast with batch stride 0,
  writing through an ``out=`` view of batch stride 320), one per :data:`SPLIT_GEMM_ROWS` rows, fill the v and k_nope
  columns, and the k_pe broadcast (:func:`broadcast_heads`: a Triton kernel on CUDA, torch's ``copy_`` elsewhere)
  writes k_pe into every head; for rows gathered from the cache the gather writes it there itself
  (:meth:`PreparedKVBProj.gemm_buffer`, :func:`mla_bridge.cache.gather_latent`'s ``k_pe_out``). No extra FLOPs.
  k_nope and v equal the identity layout's within float32 accumulation-order rounding (the GEMM sums 512 products
  instead of 512 plus 64 exact zeros); k_pe is copied exactly in both.

Which is faster is a property of the GPU's GEMM library. Measured on the H200 (bf16, DeepSeek-V2-Lite dims, gather
included), the split layout is faster than the identity layout and than the fused Triton kernel of
:mod:`mla_bridge.kernels.up_project` (which reads either layout) at 8192 and 40000 key rows (docs/results.md).
Hence the default. The bench times both (section 2, rows "mla_prefill, identity layout ...").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .dims import MLADims
from .inference import refuse_autograd

__all__ = [
    "PreparedKVBProj",
    "prepare_kv_b_proj",
    "up_projection_weight",
    "as_prepared",
    "broadcast_heads",
    "prepared_weight_elements",
    "prepared_weight_shape",
    "LAYOUTS",
    "DEFAULT_LAYOUT",
    "CHECKPOINT_LAYOUT",
    "SPLIT_GEMM_ROWS",
]

#: The up-projection layouts (see the module docstring).
LAYOUTS = ("identity", "split")
#: The layout of a raw weight handed to ``mla_prefill`` (:func:`as_prepared`): the checkpoint's
#: ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` itself, not a copy. The fused kernel reads its k_nope and v
#: rows where they lie; a separate pass's GEMM needs the split layout, made from it on first use and kept by that
#: object (:meth:`PreparedKVBProj.gemm_form`) for one call: :func:`as_prepared` gives every ``mla_prefill`` call an
#: object of its own (a held one too, :meth:`PreparedKVBProj._per_call`), so an in-place update of the weight is
#: read by every pass of the next call, never a copy from an earlier one. Not a layout :func:`prepare_kv_b_proj`
#: makes: preparing once at load time is the fast form.
CHECKPOINT_LAYOUT = "checkpoint"
#: The layout :func:`prepare_kv_b_proj` (and ``mla_prefill`` given a raw weight) uses when none is named: the one
#: place that picks the variant (why split: the module docstring).
DEFAULT_LAYOUT = "split"
#: Key rows per batched GEMM of the split layout. Every head's GEMM reads the same latent rows: split into row blocks
#: of this size (18.9 MB of 576-wide bf16 rows), they stay in L2 while the heads read them. Measured on the H200
#: (bf16): blocks of 16384 rows are about 4-8% faster than one GEMM at 40000 and 68000 rows (docs/results.md).
SPLIT_GEMM_ROWS = 16384


def _shape_key(dims: MLADims) -> tuple[int, int, int, int, int]:
    return (dims.num_heads, dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim)


def _check_raw(kv_b_proj_weight: torch.Tensor, dims: MLADims, name: str = "kv_b_proj_weight") -> None:
    if not isinstance(dims, MLADims):
        raise TypeError(f"dims must be an MLADims, got {type(dims).__name__}")
    if not isinstance(kv_b_proj_weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(kv_b_proj_weight).__name__}")
    if not kv_b_proj_weight.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {kv_b_proj_weight.dtype}")
    if kv_b_proj_weight.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {kv_b_proj_weight.layout}")
    if tuple(kv_b_proj_weight.shape) != dims.kv_b_proj_shape:
        raise ValueError(
            f"{name} must be [H*(qk_nope_head_dim+v_head_dim), kv_lora_rank] = "
            f"{list(dims.kv_b_proj_shape)}, got {list(kv_b_proj_weight.shape)}"
        )


def up_projection_weight(kv_b_proj_weight: torch.Tensor, dims: MLADims) -> torch.Tensor:
    """``kv_b_proj_weight`` rearranged for the ``"identity"`` layout (ONE GEMM of the 576-wide latent rows gives k
    and v in place).

    Returns ``[H * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim), kv_lora_rank + qk_rope_head_dim]`` in the
    weight's dtype and device: per head the k_nope rows ``[W_nope | 0]``, then ``[0 | I]`` (an identity that copies
    k_pe, exactly), then the v rows ``[W_v | 0]``. ``latent @ W.T`` viewed ``[N, H, 320]`` is ``[k (192) | v (128)]``
    per head. Allocates ``H * 320 * 576`` elements; call it once per layer (:func:`prepare_kv_b_proj`).

    Raises:
        TypeError / ValueError: ``dims`` not an :class:`MLADims`, or a weight that is not a dense floating tensor of
            shape ``dims.kv_b_proj_shape`` (as :func:`prepare_kv_b_proj`).
    """
    _check_raw(kv_b_proj_weight, dims)
    h, nope, rope, vd = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
    r = dims.kv_lora_rank
    w = kv_b_proj_weight.reshape(h, nope + vd, r)
    aug = kv_b_proj_weight.new_zeros(h, nope + rope + vd, r + rope)
    aug[:, :nope, :r] = w[:, :nope]
    aug[:, nope + rope :, :r] = w[:, nope:]
    aug[:, nope : nope + rope, r:] = torch.eye(rope, dtype=aug.dtype, device=aug.device)
    return aug.view(h * (nope + rope + vd), r + rope)


def _split_weight(kv_b_proj_weight: torch.Tensor, dims: MLADims) -> torch.Tensor:
    """``[H, v_head_dim + qk_nope_head_dim, kv_lora_rank]``: per head the v rows, then the k_nope rows (contiguous)."""
    h, nope, vd, r = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    w = kv_b_proj_weight.reshape(h, nope + vd, r)
    return torch.cat([w[:, nope:], w[:, :nope]], dim=1).contiguous()


@dataclass(frozen=True, eq=False)
class PreparedKVBProj:
    """One layer's ``kv_b_proj`` in the layout the up-projection reads, made by :func:`prepare_kv_b_proj`.

    Attributes:
        dims: the :class:`MLADims` it was prepared for (heads and widths are checked against the plan's).
        layout: "identity" or "split" (module docstring); "checkpoint" (:data:`CHECKPOINT_LAYOUT`) for a raw weight
            taken as it is by :func:`as_prepared`.
        weight: identity ``[H * 320, 576]``; split ``[H, v_head_dim + qk_nope_head_dim, kv_lora_rank]``; checkpoint
            the raw ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` (unit stride along ``kv_lora_rank``).
            Any layout: unit stride along the last dim, and a split weight's head stride a multiple of its row
            stride (what the fused kernel addresses; ValueError otherwise, at construction).
        dtype, device: the weight's (checked against the plan's by ``mla_prefill``).
    """

    dims: MLADims
    layout: str
    weight: torch.Tensor
    # Set per object by __post_init__ through object.__setattr__ (frozen), never as fields (ClassVar keeps them out of
    # the dataclass's fields): the identity or split weight transposed for the GEMM (None for the checkpoint
    # layout, whose GEMM runs on its gemm_form); the checkpoint layout's split form once made.
    _weight_t: ClassVar[torch.Tensor]
    _gemm: ClassVar[Optional["PreparedKVBProj"]]

    def __post_init__(self) -> None:
        checkpoint = self.layout == CHECKPOINT_LAYOUT
        want = self.dims.kv_b_proj_shape if checkpoint else prepared_weight_shape(self.dims, self.layout)  # raises
        # for an unknown layout
        if not isinstance(self.weight, torch.Tensor) or tuple(self.weight.shape) != want:
            got = list(self.weight.shape) if isinstance(self.weight, torch.Tensor) else type(self.weight).__name__
            raise ValueError(f"a {self.layout!r} weight must be {list(want)} (prepare_kv_b_proj makes it), got {got}")
        # the fused kernel (kernel_rows) reads each row's columns at unit stride, and a split weight's heads at a whole
        # number of rows apart; a weight made otherwise (prepare_kv_b_proj's are contiguous) would be read wrong there
        st = self.weight.stride()
        if st[-1] != 1 or (self.layout == "split" and (st[1] <= 0 or st[0] % st[1])):
            what = (
                "unit stride along kv_lora_rank"
                if checkpoint
                else "unit stride along its last dim"
                + (" and a head stride that is a multiple of its row stride" if self.layout == "split" else "")
            )
            raise ValueError(
                f"a {self.layout!r} weight must have {what}, got strides {list(st)}"
                + ("" if checkpoint else " (prepare_kv_b_proj makes it contiguous)")
            )
        # the GEMM's B operand as a view, made once (a .t() per call is host time on the per-layer path); the
        # checkpoint layout's GEMM form is made on first use (gemm_form)
        object.__setattr__(
            self,
            "_weight_t",
            None if checkpoint else self.weight.t() if self.layout == "identity" else self.weight.transpose(1, 2),
        )
        object.__setattr__(self, "_gemm", None)  # the checkpoint layout's split form, once made (never self: no cycle)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        """Device bytes the prepared weight holds (for the checkpoint layout: the caller's weight)."""
        return self.weight.numel() * self.weight.element_size()

    @property
    def gemm_layout(self) -> str:
        """The layout the separate path's GEMM runs with: :attr:`layout`, or for the checkpoint layout the split one
        it is rearranged into (:meth:`gemm_form`)."""
        return "split" if self.layout == CHECKPOINT_LAYOUT else self.layout

    def _per_call(self) -> "PreparedKVBProj":
        """This object, or for the checkpoint layout a new one over the same weight, whose split form
        (:meth:`gemm_form`) is made afresh: a copy kept from an earlier call would not see an in-place update of the
        weight, which the fused kernel reads where it lies."""
        return PreparedKVBProj(self.dims, self.layout, self.weight) if self.layout == CHECKPOINT_LAYOUT else self

    # The up-projection as mla_bridge's own passes (:mod:`mla_bridge.kv`) and the fused kernel
    # (:mod:`mla_bridge.kernels.up_project`) use it, and the absorbed form the sparse pass reads
    # (:mod:`mla_bridge.sparse`): these five methods are the whole interface between them and this module. They check
    # nothing (``mla_prefill`` validated its inputs once per layer); callers from outside use :meth:`up_project`.

    def gemm_form(self) -> "PreparedKVBProj":
        """What the separate path's GEMM reads: this object, or for the checkpoint layout its split form, made by
        :func:`prepare_kv_b_proj` on the first call and kept by this object (a copy of the weight; ``mla_prefill``
        holds the object for one call: :meth:`_per_call`). Its layout is :attr:`gemm_layout`."""
        if self.layout != CHECKPOINT_LAYOUT:
            return self
        gemm = self._gemm
        if gemm is None:
            gemm = prepare_kv_b_proj(self.weight, self.dims, layout="split")
            object.__setattr__(self, "_gemm", gemm)
        return gemm

    def kernel_rows(self) -> tuple[torch.Tensor, int, int, int, int]:
        """Where the fused kernel (:mod:`mla_bridge.kernels.up_project`) finds head ``h``'s weight rows: ``(weight,
        row stride in elements, rows per head, first k_nope row, first v row)``, the rows of head ``h`` starting at
        row ``h * rows_per_head`` and each row's first ``kv_lora_rank`` elements at unit stride (the identity
        layout's padding and identity block are never read). Any layout, the checkpoint one read in place."""
        d, w = self.dims, self.weight
        nope, rope, vd = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
        if self.layout == "identity":  # [H * (nope + rope + vd), rank + rope]: per head k_nope rows, I, v rows
            return w, w.stride(0), nope + rope + vd, 0, nope + rope
        if self.layout == "split":  # [H, vd + nope, rank]: per head v rows, then k_nope rows
            return w, w.stride(1), w.stride(0) // w.stride(1), vd, 0
        return w, w.stride(0), nope + vd, 0, nope  # checkpoint [H * (nope + vd), rank]: k_nope rows, then v rows

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight as the absorbed (MQA) form of attention reads it (:mod:`mla_bridge.sparse`): ``(W_UK [H,
        qk_nope_head_dim, kv_lora_rank], W_UV [H, v_head_dim, kv_lora_rank])``, views of :attr:`weight` (no copy;
        any layout, the identity layout's padding and identity block left out), in the weight's dtype and device.
        ``k_nope[h] = W_UK[h] @ kv_c`` and ``v[h] = W_UV[h] @ kv_c``, so ``q_nope[h] . k_nope[h] = (W_UK[h]^T
        q_nope[h]) . kv_c``. Checks nothing (the caller validated the weight)."""
        d, w = self.dims, self.weight
        h, nope, rope, vd, r = d.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
        if self.layout == "identity":  # [H * (nope + rope + vd), r + rope]: per head k_nope rows, I, v rows
            per_head = w.unflatten(0, (h, nope + rope + vd))
            return per_head[:, :nope, :r], per_head[:, nope + rope :, :r]
        if self.layout == "split":  # [H, vd + nope, r]: per head v rows, then k_nope rows
            return w[:, vd:], w[:, :vd]
        per_head = w.unflatten(0, (h, nope + vd))  # checkpoint [H * (nope + vd), r]: k_nope rows, then v rows
        return per_head[:, :nope], per_head[:, nope:]

    def gemm_buffer(self, n: int, device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """For a separate pass that gathers ``n`` rows: ``(buf, k_pe_out)``, the split layout's key/value buffer
        ``[n, H, v_head_dim + head_dim_qk]`` (per head ``[v | k_nope | k_pe]``, this weight's dtype, on ``device``)
        and the view of its k_pe columns ``[n, H, qk_rope_head_dim]``, for a gather that writes k_pe into every head
        itself (:func:`mla_bridge.cache.gather_latent`'s ``k_pe_out``) before :meth:`up_project_unchecked` with
        ``buf``; ``(None, None)`` where :attr:`gemm_layout` is "identity" (its GEMM copies k_pe through the identity
        block)."""
        if self.gemm_layout == "identity":
            return None, None
        d = self.dims
        buf = torch.empty(n, d.num_heads, d.v_head_dim + d.head_dim_qk, dtype=self.dtype, device=device)
        return buf, buf[:, :, d.v_head_dim + d.qk_nope_head_dim :]

    def up_project_unchecked(
        self, latent: torch.Tensor, k_pe: Optional[torch.Tensor] = None, buf: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`up_project` past its checks, by the GEMM of :meth:`gemm_form` (the checkpoint layout's split form
        made here on first use). ``buf``: a :meth:`gemm_buffer` whose k_pe columns are written already; then
        ``latent`` needs only its first ``kv_lora_rank`` columns and no k_pe broadcast runs here (ignored by the
        identity layout, for which :meth:`gemm_buffer` gives None)."""
        return self.gemm_form()._project(latent, k_pe, buf)

    def up_project(
        self, latent: torch.Tensor, k_pe: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows -> ``(k [N, H, qk_nope_head_dim + qk_rope_head_dim], v [N, H, v_head_dim])``: two strided views
        of one ``[N, H, 320]`` buffer, read by the attention kernels through their strides (no copy).

        ``latent``: ``[N, kv_lora_rank + qk_rope_head_dim]`` rows (kv_c ++ k_pe; any strides); or, with ``k_pe``
        ``[N, qk_rope_head_dim]`` given, ``kv_c`` ``[N, kv_lora_rank]`` alone (the new tokens' own tensors: the split
        layout reads them where they are, the identity layout concatenates them). Both in the weight's dtype, on its
        device.

        Raises:
            TypeError: a non-tensor, or a dtype other than the weight's.
            ValueError: a shape other than the above, another device, an input (or this weight) that requires grad
                while autograd records or carries a forward-mode tangent (no backward: run under
                ``torch.no_grad()``; :func:`mla_bridge.inference.refuse_autograd`) (before any GEMM runs).
        """
        d = self.dims
        width = d.latent_dim if k_pe is None else d.kv_lora_rank
        named = (("latent", latent),) + (() if k_pe is None else (("k_pe", k_pe),))
        for name, x in named:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype != self.dtype:
                raise TypeError(f"{name} must have dtype {self.dtype} (the weight's), got {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name} is on {x.device}, but the weight is on {self.device}")
        if latent.dim() != 2 or latent.shape[1] != width:
            what = (
                f"kv_lora_rank + qk_rope_head_dim={width}]"
                if k_pe is None
                else f"kv_lora_rank={width}] when k_pe is given"
            )
            raise ValueError(f"latent must be [N, {what}, got {list(latent.shape)}")
        if k_pe is not None and tuple(k_pe.shape) != (latent.shape[0], d.qk_rope_head_dim):
            raise ValueError(
                f"k_pe must be [N={latent.shape[0]}, qk_rope_head_dim={d.qk_rope_head_dim}], got {list(k_pe.shape)}"
            )
        refuse_autograd(named + (("weight", self.weight),))
        return self._per_call().up_project_unchecked(latent, k_pe)

    def _project(
        self, latent: torch.Tensor, k_pe: Optional[torch.Tensor], buf: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`up_project_unchecked` on a weight of the identity or split layout."""
        d = self.dims
        h, qk, vd, r = d.num_heads, d.head_dim_qk, d.v_head_dim, d.kv_lora_rank
        n = latent.shape[0]
        if self.layout == "identity":
            if k_pe is not None:
                latent = torch.cat([latent, k_pe], dim=-1)
            out = torch.mm(latent, self._weight_t).view(n, h, qk + vd)
            return out[..., :qk], out[..., qk:]
        broadcast = buf is None
        if broadcast:
            buf = torch.empty(n, h, vd + qk, dtype=latent.dtype, device=latent.device)
        assert buf is not None  # given, or made just above
        gemm_cols = vd + d.qk_nope_head_dim
        # Each row block's operands as ONE view each (as_strided: a view op costs host time per layer): the block's
        # kv_c columns broadcast over heads (batch stride 0), and its [v | k_nope] columns of buf heads first
        # (buf is contiguous [n, h, vd + qk]).
        a_row, a_col = latent.stride()
        o_row = h * (vd + qk)
        for start in range(0, n, SPLIT_GEMM_ROWS):
            rows = min(n - start, SPLIT_GEMM_ROWS)
            torch.bmm(
                latent.as_strided((h, rows, r), (0, a_row, a_col), latent.storage_offset() + start * a_row),
                self._weight_t,
                out=buf.as_strided((h, rows, gemm_cols), (vd + qk, o_row, 1), buf.storage_offset() + start * o_row),
            )
        if broadcast:
            broadcast_heads(buf[:, :, gemm_cols:], latent[:, r:] if k_pe is None else k_pe)
        return buf[..., vd:], buf[..., :vd]

    def __repr__(self) -> str:
        return (
            f"PreparedKVBProj(layout={self.layout!r}, heads={self.dims.num_heads}, "
            f"weight={list(self.weight.shape)}, dtype={self.dtype}, device={self.device})"
        )


def prepared_weight_shape(dims: MLADims, layout: Optional[str] = None) -> tuple[int, ...]:
    """The shape of the weight :func:`prepare_kv_b_proj` makes for ``layout`` (default :data:`DEFAULT_LAYOUT`):
    identity ``[H * (head_dim_qk + v_head_dim), kv_lora_rank + qk_rope_head_dim]``, split ``[H, v_head_dim +
    qk_nope_head_dim, kv_lora_rank]``. Raises ValueError for another layout."""
    layout = DEFAULT_LAYOUT if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    d = dims
    if layout == "identity":
        return (d.num_heads * (d.head_dim_qk + d.v_head_dim), d.latent_dim)
    return (d.num_heads, d.v_head_dim + d.qk_nope_head_dim, d.kv_lora_rank)


def prepared_weight_elements(dims: MLADims, layout: Optional[str] = None) -> int:
    """Elements of :func:`prepared_weight_shape` (for :func:`mla_bridge.prefill.prefill_memory_bytes`)."""
    return math.prod(prepared_weight_shape(dims, layout))


def broadcast_heads(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The k_pe broadcast: ``dst[i, h, :] = src[i, :]`` for ``dst`` ``[N, H, qk_rope_head_dim]`` (a view into a key
    buffer) and ``src`` ``[N, qk_rope_head_dim]`` (any strides) of the same dtype and device. An exact copy. The
    one place choosing how: the Triton kernel of :mod:`mla_bridge.kernels.broadcast` on CUDA where Triton imports
    (torch's ``copy_`` of the expanded view was 3x slower there), torch's ``copy_`` elsewhere."""
    from .kernels import triton_available

    if dst.is_cuda and triton_available():
        from .kernels.broadcast import broadcast_heads_triton

        broadcast_heads_triton(dst, src)
    else:
        dst.copy_(src.unsqueeze(1).expand_as(dst))


def prepare_kv_b_proj(
    kv_b_proj_weight: torch.Tensor, dims: MLADims, *, layout: Optional[str] = None
) -> PreparedKVBProj:
    """Prepare one layer's ``kv_b_proj.weight`` once (at load time) for every later :func:`mla_bridge.mla_prefill`.

    Args:
        kv_b_proj_weight: ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` as stored in DeepSeek
            checkpoints, in the dtype and on the device the layer runs in (the prepared copy keeps both).
        dims: the layer's :class:`MLADims`.
        layout: "identity" or "split" (module docstring); default :data:`DEFAULT_LAYOUT`.

    Returns:
        A :class:`PreparedKVBProj` (a new tensor; the raw weight may be freed afterwards). Identity layout:
        ``H * 320 * 576`` elements (5.9 MB at bf16 for 16 heads); split: ``H * 256 * 512``.

    Raises:
        TypeError: ``dims`` not an MLADims, a weight that is not a dense floating tensor.
        ValueError: a weight shape other than ``dims.kv_b_proj_shape``, an unknown layout.
    """
    _check_raw(kv_b_proj_weight, dims)
    layout = DEFAULT_LAYOUT if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    with torch.no_grad():
        w = kv_b_proj_weight.detach()
        weight = up_projection_weight(w, dims) if layout == "identity" else _split_weight(w, dims)
    return PreparedKVBProj(dims, layout, weight)


def as_prepared(
    kv_b_proj_weight: "torch.Tensor | PreparedKVBProj",
    dims: MLADims,
    dtype: torch.dtype,
    device: torch.device,
    name: str = "kv_b_proj_weight",
) -> PreparedKVBProj:
    """What ``mla_prefill`` up-projects with: a :class:`PreparedKVBProj` checked against the plan's dims, dtype and
    device, or a raw weight checked the same way and taken as it is (:data:`CHECKPOINT_LAYOUT`: no copy; its split
    form is made where a separate pass first needs it, so at most once per call); a raw weight whose rows are not at
    unit stride is prepared now (:data:`DEFAULT_LAYOUT`). A checkpoint-layout PreparedKVBProj comes back as a new
    object over the same weight (its split form made afresh for this call).

    Raises:
        TypeError: neither a tensor nor a PreparedKVBProj; a dtype other than ``dtype``; a sparse tensor.
        ValueError: prepared for other dims, a raw shape other than ``dims.kv_b_proj_shape``, another device.
    """
    if isinstance(kv_b_proj_weight, PreparedKVBProj):
        p = kv_b_proj_weight
        if _shape_key(p.dims) != _shape_key(dims):
            raise ValueError(
                f"{name} was prepared for {p.dims.num_heads} heads, kv_lora_rank {p.dims.kv_lora_rank}, "
                f"qk_nope/rope/v {p.dims.qk_nope_head_dim}/{p.dims.qk_rope_head_dim}/{p.dims.v_head_dim}, "
                f"but the plan has {dims.num_heads} heads, kv_lora_rank {dims.kv_lora_rank}, "
                f"{dims.qk_nope_head_dim}/{dims.qk_rope_head_dim}/{dims.v_head_dim}"
            )
        if p.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype} (the plan's), got a PreparedKVBProj of {p.dtype}")
        if p.device != device:
            raise ValueError(f"{name} is on {p.device}, but the plan is on {device}")
        return p._per_call()
    if not isinstance(kv_b_proj_weight, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor or a PreparedKVBProj (mla_bridge.prepare_kv_b_proj), "
            f"got {type(kv_b_proj_weight).__name__}"
        )
    if kv_b_proj_weight.device != device:
        raise ValueError(f"{name} is on {kv_b_proj_weight.device}, but the plan is on {device}")
    if kv_b_proj_weight.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} (the plan's), got {kv_b_proj_weight.dtype}")
    _check_raw(kv_b_proj_weight, dims, name)
    if kv_b_proj_weight.stride(1) != 1:  # not readable in place by the fused kernel: the split copy now
        return prepare_kv_b_proj(kv_b_proj_weight, dims)
    w = kv_b_proj_weight.detach() if kv_b_proj_weight.requires_grad else kv_b_proj_weight
    return PreparedKVBProj(dims, CHECKPOINT_LAYOUT, w)
