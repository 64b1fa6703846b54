"""``PrefillPlan``: a prefill planned once on its layouts (shapes, strides, dtypes, the mask
description and, for variable length, the sequence offsets), then run on any arrays of
those layouts, as FlashInfer's ``plan`` / ``run``. It stands on the C ABI's plan
(``mlxn_prefill_plan_*``): each run passes the arrays' addresses in one call; on CUDA it
is enqueued on the caller's stream, with no host synchronisation and no allocation by the
library, so it can be captured in a CUDA graph."""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple, Optional

import numpy as np

from ._lib import check, ffi, get_string, lib
from .arrays import ALLOCATION_FAILURES, Operand, allocation_error, direct_outputs, output
from .checks import (
    check_alibi_slopes,
    check_cu_seqlens,
    check_inputs_finite,
    check_sinks,
    default_scale,
)
from .device import Encoder
from .dtypes import DTYPE_CODES, numpy_dtype_of_name
from .errors import BufferAllocationError, InvalidArgumentError, not_picklable
from .layouts import layout as read_layout
from .layouts import HND_HINT, ArraySpec, check_qkv, nhd_view, norm_strides, operand, pick_device, span
from .masks import described_pairs, masked_pairs, prepare_mask
from .options import PrefillArgs, checked, from_keywords, run_options, signature
from .paged import cache_views, check_paged, refuse_unpaged_arguments
from .quant import KV_FORMATS, descale_values, kv_format, logical_views

__all__ = ["ArraySpec", "PrefillPlan"]


def _free(handle: int) -> None:
    try:
        lib.mlxn_prefill_plan_free(handle)
    except Exception:  # pragma: no cover - at interpreter exit
        pass


class PrefillPlan:
    """One prefill planned on its layouts and runnable many times (FlashInfer's ``plan``
    and ``run``); :func:`~mlx_native.flash_attn_prefill` keeps one per layout and takes
    the same arguments.

    ``q``, ``k``, ``v`` and ``mask`` are arrays or :class:`ArraySpec` (layouts without
    data): the plan reads only their shapes, strides, dtypes and devices (and the values of
    ``cu_seqlens_q`` / ``cu_seqlens_k``, which belong to the plan). Every argument is
    checked here, before anything runs.

    - ``run(q, k, v, mask=None, *, sinks=None, out=None, lse=None)`` runs on arrays of the
      planned layouts and returns ``out`` (``(out, lse)`` with ``return_lse``), new arrays
      of q's library on q's device unless given (contiguous, of the planned shapes and
      dtypes). ``run()`` with no arrays runs on those the plan was made with.
    - ``softcap``, ``max_bias``, ``sinks``: SPEC 10, as in
      :func:`~mlx_native.flash_attn_prefill`; the two numbers belong to the plan, the sinks
      (float32 ``[heads]``, or an :class:`ArraySpec` of them) are data given to each run.
    - On CUDA a run is enqueued on the caller's current stream (PyTorch's for tensors,
      CuPy's for CuPy arrays) and returns at once, with no host synchronisation and no
      allocation but the outputs' (by the caller's library; none when ``out`` and ``lse``
      are given) and, where the shape splits its walk over the cache, the run's workspace
      (:attr:`workspace_bytes`, the same way): it can be captured in a
      ``torch.cuda.CUDAGraph`` and replayed. The plan owns the explicit mask's tile table,
      so runs of one plan with a mask must not overlap on different streams.
    - ``layout``: ``"NHD"`` (q ``[..., rows, heads, head_dim]``, the default) or ``"HND"``
      (``[..., heads, rows, head_dim]``, PyTorch SDPA's), for q, k, v and the output alike;
      read in place through the strides, written by the kernel in that layout.
    - ``encode(encoder, classify=True)`` records the planned arrays' run on an encoder
      (the benchmarks record many and commit once; paged plans too); ``encoded_result()``
      is its output.
    - ``visible_pairs``: the (query row, cache row) pairs the mask leaves visible, the
      useful work of SPEC 5 (None for an explicit mask planned without data).
    - How it runs: ``kv_splits`` (CUDA: the parts each walk over the cache is cut into; 0
      or 1 never, 2, 4, 8 or 16 always), ``cta_pairs`` (CUDA's Hopper form: ``"auto"``,
      ``"off"`` or ``"queries"``), ``cuda_form`` (``"auto"`` or ``"portable"``, the
      mma.sync form on any GPU) and ``cpu_isa`` (an instruction set of
      ``cpu_info()["detected"]``, or ``"amx-emulated"``); None each: the library's choice
      (which the environment variables of the README's table override). ``choices`` says
      what the plan's backend chose under them.

    Host arrays planned for a CUDA device (``device="cuda"``) are uploaded by each run
    (``run()`` with no arrays uploads them once) and the result is downloaded into q's
    library.
    """

    def __init__(self, q: Any, k: Any, v: Any, mask: Any = None, **keywords: Any):
        self._plan(q, k, v, checked(from_keywords("PrefillPlan", mask, keywords)))

    @classmethod
    def from_args(cls, q: Any, k: Any, v: Any, args: PrefillArgs) -> "PrefillPlan":
        """The plan of ``q``, ``k``, ``v`` with ``args`` already checked (:func:`checked`),
        as the array call makes it."""
        plan = cls.__new__(cls)
        plan._plan(q, k, v, args)
        return plan

    def _plan(self, q: Any, k: Any, v: Any, args: PrefillArgs) -> None:
        causal, window, offset, scale = args.causal, args.window, args.offset, args.scale
        mask, cu_seqlens_q, cu_seqlens_k = args.mask, args.cu_seqlens_q, args.cu_seqlens_k
        sinks, alibi_slopes, out_dtype = args.sinks, args.alibi_slopes, args.out_dtype
        self.layout, self.softcap, self.max_bias = args.layout, args.softcap, args.max_bias
        self._lse, self._check_finite, dev_arg = args.return_lse, args.check_finite, args.device
        hnd = self.layout == "HND"
        qo, ko, vo = operand(q, "q"), operand(k, "k"), operand(v, "v")
        if hnd:  # the kernels read [..., rows, heads, head_dim] through these strides
            qo, ko, vo = nhd_view(qo), nhd_view(ko), nhd_view(vo)
        # Paged K/V (SPEC 11, paged.py): k and v are caches of blocks, read through a block table.
        self._paged = None
        paged = args.block_table is not None or args.seqused_k is not None
        if paged:
            refuse_unpaged_arguments(args.block_table, cu_seqlens_k)
        # Quantised K/V (SPEC 11, quant.py): FP8 or Q8_0 bytes, checked as float16 stand-ins of
        # the values' shapes; the kernels read the bytes through the arrays' own strides.
        self._kv_format = kv_format(args.kv_dtype, ko, vo)
        kc, vc = ko, vo
        if self._kv_format is not None:
            kc, vc = logical_views(self._kv_format, ko, vo)
        elif args.k_descale is not None or args.v_descale is not None:
            descale_values(args.k_descale if args.k_descale is not None else args.v_descale,
                           "k_descale" if args.k_descale is not None else "v_descale", None, 0)  # fmt: skip
        check_qkv(qo, *(cache_views(qo, kc, vc) if paged else (kc, vc)), self.layout)
        if self._kv_format is not None:  # the format's own kernels (Q8_0: head dims multiples of 32)
            check(lib.mlxn_flash_attn_prefill_supports(qo.shape[-1], vc.shape[-1], KV_FORMATS[self._kv_format]))
        self._kv_to_half = False
        batched = qo.ndim == 4
        rows, n_heads, head_dim = qo.shape[-3:]
        kv_len, n_kv_heads, head_dim_v = ko.shape[-3], ko.shape[-2], vc.shape[-1]
        self._descale = tuple(
            descale_values(x, name, self._kv_format, n_kv_heads)
            for x, name in ((args.k_descale, "k_descale"), (args.v_descale, "v_descale"))
        )
        self._has_sinks = sinks is not None
        if self._has_sinks:
            check_sinks(operand(sinks, "sinks"), n_heads)
        if self.max_bias > 0 and mask is None and not causal:
            raise InvalidArgumentError(
                "ALiBi needs positions: pass causal=True, a window, or an explicit mask holding -|i-j| (max_bias > 0 "
                "scales the mask by each head's slope)"
            )
        self._cu = None
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            if batched:
                raise InvalidArgumentError(
                    "cu_seqlens go with 3-D q [total_q, heads, head_dim] and k/v [total_k, kv_heads, head_dim] "
                    f"(FlashAttention's variable length), got a 4-D q of shape {qo.shape}"
                )
            if mask is not None:
                raise InvalidArgumentError(
                    "an explicit mask cannot go with cu_seqlens: describe the mask (causal, window) or pad the batch "
                    "to a fixed length ([B, rows, heads, head_dim]) and pass a [B, 1, rows, kv] mask"
                )
            if paged:  # the queries' offsets alone (the caches' lengths are seqused_k's, checked by the op)
                self._cu = check_cu_seqlens(cu_seqlens_q, cu_seqlens_q, rows, rows, False)
            else:
                self._cu = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, rows, kv_len, causal and offset is None)
            batch = len(self._cu[0]) - 1
        else:
            batch = qo.shape[0] if batched else 1
            if causal and offset is None and kv_len < rows and not paged:
                raise InvalidArgumentError(
                    f"causal with {rows} query rows and a cache of {kv_len} rows: the prompt is the end of its cache, "
                    f"which cannot be shorter (pass the whole cache as k/v, or causal=False with an explicit mask)"
                    + ("" if hnd else f"; {HND_HINT}")
                )
        if paged:
            self._paged = check_paged(args.block_table, args.seqused_k, ko, vo, batch)
            kv_len = int(self._paged.seqused_k.max(initial=0))  # an explicit mask's columns: the longest cache
            if self._cu is not None:
                self._cu = (self._cu[0], self._paged.cu_seqlens_k().astype(np.int32))
        self.device, self._upload = pick_device(dev_arg, qo)
        if ko.dtype == np.float32 and self.device.backend != "cpu":
            # CUDA and Metal have no float32 K/V kernels: each run converts K and V to float16
            # (round to nearest even, with the arrays' own library on their device), and the
            # plan is made for those contiguous copies (docs/spec.md, "float32 K/V").
            self._kv_to_half = True
            ko, vo = ko.half_copy(), vo.half_copy()
        self._has_alibi = alibi_slopes is not None
        self._alibi_batched = False
        if self._has_alibi:
            ao = check_alibi_slopes(operand(alibi_slopes, "alibi_slopes"), n_heads, batch, self.max_bias)
            self._alibi_batched = ao.ndim == 2
            self._alibi_shape = ao.shape
        self._cuda = self.device.backend == "cuda" and not self._upload
        self._array_device = qo.device
        # q's dtype (checked by check_qkv) unless the options name another (checked there).
        self.out_dtype = qo.dtype if out_dtype is None else numpy_dtype_of_name(out_dtype)
        self.scale = default_scale(head_dim) if scale is None else scale
        self.causal, self.window, self.offset, self.batch = causal, window, offset, batch
        self._dims = (rows, kv_len, n_heads, n_kv_heads, head_dim)
        self._n_heads = n_heads
        self._layouts = tuple(read_layout(o, hnd) for o in (qo, ko, vo))

        self._mask_form = None
        mask_strides = (0, 0)
        mask_in_place = mask is None
        if mask is not None:
            mo = operand(mask, "mask")
            core, bs, rs = prepare_mask(mo, batch=batch, rows=rows, kv_len=kv_len, like=qo)
            mask_in_place = (
                core.obj is not None and core.ptr == mo.ptr and core.library == mo.library == qo.library
                and mo.converted is None
            )  # fmt: skip
            self._mask_form = (core.shape, bs, rs)
            mask_strides = (bs, rs)

        # Outputs: like q (in its layout) with v's head dim, contiguous; lse [H, rows], [B, H, rows]
        # or [H, total_q] in either layout.
        self.shape = qo.shape[:-1] + (head_dim_v,)
        out_strides = (rows * n_heads * head_dim_v if batched else 0, n_heads * head_dim_v, head_dim_v)
        if hnd:  # [..., heads, rows, dv]: the kernel writes each (row, head) through these strides
            self.shape = self.shape[:-3] + (n_heads, rows, head_dim_v)
            out_strides = (out_strides[0], head_dim_v, rows * head_dim_v)
        self.lse_shape = (batch, n_heads, rows) if batched else (n_heads, rows)
        p = ffi.new("MlxnFlashAttnPrefillParams *")
        qs, ks, vs = (lay[1] for lay in self._layouts)
        if not batched:  # (the paged caches' strides are (block, row, head) already)
            qs = (0,) + qs
            ks, vs = (ks, vs) if paged else ((0,) + ks, (0,) + vs)
        p.q_strides, p.k_strides, p.v_strides = qs[:3], ks[:3], vs[:3]
        p.out_strides = out_strides
        p.mask_strides = mask_strides
        p.lse_strides = (n_heads * rows if batched else 0, rows)
        p.batch, p.rows, p.kv_len = batch, rows, kv_len
        p.n_heads, p.n_kv_heads, p.head_dim = n_heads, n_kv_heads, head_dim
        p.causal, p.window, p.scale = int(causal), (window or 0) if not isinstance(window, tuple) else 0, self.scale
        p.offset, p.has_offset = offset or 0, int(offset is not None)
        p.head_dim_v, p.softcap, p.max_bias = head_dim_v, self.softcap, self.max_bias
        if isinstance(window, tuple):  # two-sided, without causal
            p.window = window[0] + 1 if window[0] >= 0 else 0
            p.window_right, p.has_window_right = max(window[1], 0), int(window[1] >= 0)
        p.alibi_slopes = (2 if self._alibi_batched else 1) if self._has_alibi else 0
        self._params = p

        out = ffi.new("uint64_t *")
        cq = ffi.NULL if self._cu is None else ffi.from_buffer("int32_t[]", self._cu[0])
        ck = ffi.NULL if self._cu is None else ffi.from_buffer("int32_t[]", self._cu[1])
        kv_code = DTYPE_CODES[ko.dtype.name] if self._kv_format is None else KV_FORMATS[self._kv_format]
        codes = (DTYPE_CODES[qo.dtype.name], kv_code, DTYPE_CODES[self.out_dtype.name])
        descale = _descale_struct(*self._descale)
        flags = (int(mask is not None), int(self._lse), int(self._has_sinks))
        self._options = _run_options(run_options(args))
        if self._paged is not None:
            pg = self._paged
            table, used = ffi.from_buffer("int32_t[]", pg.block_table), ffi.from_buffer("int32_t[]", pg.seqused_k)
            check(lib.mlxn_prefill_plan_new_paged(self.device.handle, p, *codes, *flags, cq, table,
                                                  pg.block_table.shape[1], used, pg.num_blocks, pg.block_size,
                                                  descale[0], self._options[0], out))  # fmt: skip
        else:
            check(lib.mlxn_prefill_plan_new(self.device.handle, p, *codes, *flags, cq, ck, descale[0], self._options[0],
                                            out))  # fmt: skip
        self._handle = int(out[0])
        self._finalizer = weakref.finalize(self, _free, self._handle)
        ext = ffi.new("MlxnPrefillExtents *")
        check(lib.mlxn_prefill_plan_extents(self._handle, ext))
        self._extents = dict(out=int(ext.out), lse=int(ext.lse), blk=int(ext.blk), workspace=int(ext.workspace))

        # What a call of flash_attn_prefill on arrays of these very layouts (its cache's key)
        # may skip: building operands, checking layouts, converting or copying.
        # (Every array of q's library: the path takes each one's address with q's library's function.)
        direct = (
            qo.library in ("numpy", "torch") and ko.library == vo.library == qo.library
            and qo.in_place and ko.in_place and vo.in_place and mask_in_place
            and qo.converted is None and ko.converted is None and vo.converted is None
            and not self._upload and not self._check_finite and not self._has_sinks
            and not self._has_alibi and not self._kv_to_half
        )  # fmt: skip
        self._direct = direct_outputs(qo, self.shape, self.lse_shape, self.out_dtype) if direct else None

        data = [x for x in (q, k, v, mask, sinks, alibi_slopes) if x is not None]
        self._planned = None if any(isinstance(x, ArraySpec) for x in data) else (q, k, v, mask)
        self._planned_sinks = sinks
        self._planned_alibi = alibi_slopes
        self._lock = threading.RLock()
        self._bufs = None
        self._scratch = None
        self._planned_ops = None
        self._enc_out = None
        self._classified = False
        self._pairs = None
        if self._paged is not None and self._cu is None and mask is None:  # each sequence's own cache length
            self._pairs = sum(described_pairs(rows, int(lk), causal, window, offset) for lk in self._paged.seqused_k)

    __init__.__signature__ = signature(__init__)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ facts

    @property
    def handle(self) -> int:
        """The C ABI plan handle."""
        return self._handle

    @property
    def choices(self) -> dict:
        """What the plan's backend chose under its options, so that a fallback shows:
        ``form`` (``"cpu"``, ``"hopper"``, ``"portable"``, ``"metal"``), and where they
        apply ``arch`` (the CUDA target), ``pairs`` (the CTA-pair forms allowed: ``"auto"``,
        ``"queries"`` or ``"off"``), ``splits`` (the parts of a run given its workspace; 1
        when the walk is not split) and ``isa`` (the CPU kernels' instruction set)."""
        report = get_string(lib.mlxn_prefill_plan_choices, self._handle)
        pairs = dict(item.split("=", 1) for item in report.split(";") if item)
        if "splits" in pairs:
            pairs["splits"] = int(pairs["splits"])
        return pairs

    @property
    def has_mask(self) -> bool:
        return self._mask_form is not None

    @property
    def workspace_bytes(self) -> int:
        """Bytes of scratch each run allocates (with q's library, on q's device, as the
        outputs) to go faster: on CUDA, when the shape's tiles leave most of the GPU idle (a
        few hundred rows against a long cache), the walk over the cache is split into parts
        that run side by side and are merged (SPEC 8). 0 where the run is not split."""
        return self._extents["workspace"]

    @property
    def visible_pairs(self) -> Optional[int]:
        """The (query row, cache row) pairs the description and the explicit mask leave
        visible, over the batch: SPEC 5's useful work is ``4 * head_dim * n_heads`` times
        this. From the description in closed form; with an explicit mask, counted on the
        planned mask once (on its device; None when it was planned without data)."""
        if self._pairs is None:
            rows, kv_len = self._dims[0], self._dims[1]
            if self._mask_form is not None:
                if self._planned is None:
                    return None
                core = self._bind_mask(self._planned[3], Operand.of(self._planned[0], "q"))
                self._pairs = masked_pairs(core, self.batch, rows, kv_len, self.causal, self.window, self.offset)
            elif self._cu is not None:
                lq, lk = np.diff(self._cu[0]), np.diff(self._cu[1])
                self._pairs = sum(
                    described_pairs(int(a), int(b), self.causal, self.window, self.offset) for a, b in zip(lq, lk)
                )
            else:
                self._pairs = self.batch * described_pairs(rows, kv_len, self.causal, self.window, self.offset)
        return self._pairs

    def __repr__(self) -> str:
        rows, kv_len, nh, nkv, hd = self._dims
        what = "variable length" if self._cu is not None else f"batch {self.batch}"
        mask = ", explicit mask" if self.has_mask else ""
        mask += f", softcap {self.softcap:g}" if self.softcap else ""
        mask += f", ALiBi max_bias {self.max_bias:g}" if self.max_bias else ""
        mask += ", sinks" if self._has_sinks else ""
        mask += ", ALiBi slopes" if self._has_alibi else ""
        if isinstance(self.window, tuple):
            desc = f"window (left {self.window[0]}, right {self.window[1]})"
        else:
            desc = f"window {self.window}" if self.window else ("causal" if self.causal else "no description")
        if self.offset is not None:
            desc += f", offset {self.offset}"
        if self.layout != "NHD":
            desc += f", layout {self.layout}"
        if self._paged is not None:
            desc += f", paged K/V (blocks of {self._paged.block_size})"
        if self._kv_format is not None:
            desc += f", {self._kv_format} K/V" + (" with descale" if any(d is not None for d in self._descale) else "")
        return (
            f"PrefillPlan({what}, {rows} rows, {kv_len} cache rows, {nh}/{nkv} heads, dim {hd}, {desc}{mask}, "
            f"scale {self.scale:g}, out {self.out_dtype.name}{', lse' if self._lse else ''}, on {self.device.backend})"
        )

    def __reduce__(self):
        raise not_picklable(
            self,
            "a plan of this process's native library (and, on CUDA, device state)",
            "Pickle the arrays (or ArraySpec layouts) and arguments, and make the plan in the other process",
        )

    # ------------------------------------------------------------------ running

    def run(
        self,
        q: Any = None,
        k: Any = None,
        v: Any = None,
        mask: Any = None,
        *,
        sinks: Any = None,
        alibi_slopes: Any = None,
        out: Any = None,
        lse: Any = None,
    ) -> Any:
        """Run on ``q``, ``k``, ``v`` (and ``mask`` when the plan has one, ``sinks`` when it
        has sinks) of the planned layouts, or with no arrays on the planned ones. Returns
        ``out``, or ``(out, lse)`` when the plan returns lse. With ``check_finite`` the
        inputs are checked first.

        Every run takes the same steps: the arrays bound to the plan (checked against its
        layouts), their values checked where asked, then one launch."""
        if lse is not None and not self._lse:
            raise InvalidArgumentError("this plan returns no lse: make one with return_lse=True to pass lse=")
        if q is None and k is None and v is None:
            if self._planned is None:
                raise InvalidArgumentError("this plan was made from layouts (ArraySpec): pass the arrays, run(q, k, v, ...)")
            q, k, v, planned_mask = self._planned
            mask = planned_mask if mask is None else mask
            sinks = self._planned_sinks if sinks is None else sinks
            # Host arrays for a CUDA device are bound and uploaded once, by the first such run.
            ops = self._planned_operands() if self._upload else self._operands(q, k, v, mask, sinks, alibi_slopes)
        elif q is None or k is None or v is None:
            raise InvalidArgumentError("pass q, k and v (or none of them: the arrays the plan was made with)")
        else:
            ops = self._operands(q, k, v, mask, sinks, alibi_slopes)
        if self._check_finite:
            # (Quantised K/V's bytes are not checked: a Q8_0 or raw FP8 byte is no float to check.)
            quant = self._kv_format is not None
            check_inputs_finite(ops.q.obj, None if quant else ops.k.obj, None if quant else ops.v.obj, mask,
                                _obj(ops.sinks), self.scale)  # fmt: skip
        return self._launch(ops, out, lse)

    __call__ = run

    def _operands(self, q: Any, k: Any, v: Any, mask: Any, sinks: Any, alibi_slopes: Any) -> "_Operands":
        """The arrays of a run bound to the plan: checked against its layouts, copied where
        the kernels cannot read them in place."""
        qo = self._bind(q, "q", 0)
        return _Operands(
            qo, self._bind(k, "k", 1), self._bind(v, "v", 2), self._bind_mask(mask, qo), self._bind_sinks(sinks),
            self._bind_alibi(alibi_slopes),
        )  # fmt: skip

    def _planned_operands(self) -> "_Operands":
        """The planned arrays bound, with their buffers (:attr:`_buffers`, made once)."""
        with self._lock:
            if self._bufs is None:
                self._bufs = self._make_buffers()
            return self._planned_ops

    def _launch(self, ops: "_Operands", out: Any, lse: Any) -> Any:
        """One launch on bound operands: through the plan's C call with their addresses, or,
        for host arrays on a CUDA device (which have no device address to pass), through an
        encoder over uploaded copies, downloaded into q's library."""
        if self._upload:
            with self._lock:  # upload runs share their outputs' buffers until downloaded
                planned = self._bufs is not None and ops is self._planned_ops
                return self._run_buffers(self._bufs if planned else self._uploaded(ops), out, lse, ops.q)
        qo = ops.q
        oo = output(out, qo, "out", self.shape, self.out_dtype)
        lo = output(lse, qo, "lse", self.lse_shape, np.float32) if self._lse else None
        stream = qo.run_stream() if self._cuda else 0
        # The split's scratch, for this run alone (q's library allocates it, as the outputs).
        wo = qo.new_empty((self._extents["workspace"],), np.uint8) if self._cuda and self._extents["workspace"] else None
        _run(self._handle, qo.ptr, ops.k.ptr, ops.v.ptr, _ptr(ops.mask), oo.ptr, _ptr(lo), stream, _ptr(ops.sinks),
             _ptr(wo), _ptr(ops.alibi))  # fmt: skip
        return (oo.obj, lo.obj) if lo is not None else oo.obj

    def _run_call(self, q: Any, k: Any, v: Any, mask: Any, sinks: Any = None, alibi_slopes: Any = None):
        """:meth:`run` for arrays whose layouts (``arrays.layout_key``) are those this plan
        was made from: the one call's path. Where the plan found them usable as they are
        (``_direct``), binding them would find nothing new: their addresses go to the same C
        call at once."""
        d = self._direct
        if d is None:
            return self.run(q, k, v, mask, sinks=sinks, alibi_slopes=alibi_slopes)
        new_out, new_lse, ptr = d
        try:
            o = new_out(q)
            lse = new_lse(q) if self._lse else None
        except BufferAllocationError:
            raise  # check_host_fits's, already this form
        except ALLOCATION_FAILURES as e:
            raise allocation_error(self.shape, self.out_dtype, self._array_device, e) from e
        stream, ws = 0, None
        if self._cuda:
            import torch

            stream = torch.cuda.current_stream(q.device).cuda_stream or 1
            if self._extents["workspace"]:  # the split's scratch, for this run alone
                ws = torch.empty((self._extents["workspace"],), dtype=torch.uint8, device=q.device)
        _run(self._handle, ptr(q), ptr(k), ptr(v), None if mask is None else ptr(mask), ptr(o),
             None if lse is None else ptr(lse), stream, None, None if ws is None else ptr(ws), None)  # fmt: skip
        return (o, lse) if lse is not None else o

    def _bind(self, x: Any, name: str, i: int) -> Operand:
        op = Operand.of(x, name)
        if self._kv_to_half and i in (1, 2):
            if op.dtype != np.float32:
                raise InvalidArgumentError(f"{name} is {op.dtype.name}; this plan was made for float32 {name}")
            op = op.half_copy()
        if not op.in_place:
            op = op.made_contiguous()
        if self.layout == "HND":
            op = nhd_view(op)
        shape, strides, dtype = self._layouts[i]
        if op.shape != shape or op.dtype != dtype or norm_strides(op.shape, op.strides) != strides:
            raise InvalidArgumentError(
                f"{name} is {op.dtype.name} {op.shape} with strides {op.strides}; this plan was made for {dtype.name} "
                f"{shape} with strides {strides}: make a plan for it (flash_attn_prefill keeps one per layout)"
            )
        if op.device != self._array_device:
            raise InvalidArgumentError(f"{name} is on {op.device}; this plan runs on arrays on {self._array_device}")
        return op

    def _bind_sinks(self, sinks: Any) -> Optional[Operand]:
        """The sinks of a run: float32 ``[heads]`` on the planned arrays' device (a strided
        view is copied), or None for a plan without sinks."""
        if not self._has_sinks:
            if sinks is not None:
                raise InvalidArgumentError("this plan has no attention sinks: make one with sinks=... to pass them")
            return None
        if sinks is None:
            raise InvalidArgumentError(f"this plan has attention sinks: pass sinks, float32 [{self._n_heads}]")
        op = check_sinks(Operand.of(sinks, "sinks"), self._n_heads)
        if not op.contiguous:
            op = op.made_contiguous()
        if op.device != self._array_device:
            raise InvalidArgumentError(f"sinks are on {op.device}; this plan runs on arrays on {self._array_device}")
        return op

    def _bind_alibi(self, slopes: Any) -> Optional[Operand]:
        """The ALiBi slopes of a run: float32 of the planned shape on the planned arrays'
        device (a strided view is copied), or None for a plan without them. Their values
        are checked finite (on the device for device arrays: a synchronisation, so only
        with ``check_finite`` there)."""
        if not self._has_alibi:
            if slopes is not None:
                raise InvalidArgumentError("this plan has no ALiBi slopes: make one with alibi_slopes=... to pass them")
            return None
        if slopes is None:
            raise InvalidArgumentError(f"this plan has ALiBi slopes: pass alibi_slopes, float32 {self._alibi_shape}")
        op = Operand.of(slopes, "alibi_slopes")
        values = not op.on_cuda or self._check_finite
        op = check_alibi_slopes(op, self._n_heads, self.batch, 0.0, values=values)
        if op.shape != self._alibi_shape:
            raise InvalidArgumentError(f"alibi_slopes has shape {op.shape}; this plan was made for {self._alibi_shape}")
        if not op.contiguous:
            op = op.made_contiguous()
        if op.device != self._array_device:
            raise InvalidArgumentError(f"alibi_slopes are on {op.device}; this plan runs on arrays on {self._array_device}")
        return op

    def _bind_mask(self, mask: Any, like: Operand) -> Optional[Operand]:
        if self._mask_form is None:
            if mask is not None:
                raise InvalidArgumentError("this plan has no explicit mask: make one with a mask to pass one")
            return None
        if mask is None:
            raise InvalidArgumentError("this plan has an explicit mask: pass one of the planned layout")
        rows, kv_len = self._dims[0], self._dims[1]
        core, bs, rs = prepare_mask(mask, batch=self.batch, rows=rows, kv_len=kv_len, like=like)
        if (core.shape, bs, rs) != self._mask_form:
            raise InvalidArgumentError(
                f"the mask's kernel form is {core.shape} with (batch, row) strides {(bs, rs)}; this plan was made for "
                f"{self._mask_form[0]} with {self._mask_form[1:]}: make a plan for it"
            )
        return core

    # ------------------------------------------------------------------ buffers and encoders

    @property
    def _buffers(self) -> dict:
        """Library buffers over the planned arrays (uploaded once for a CUDA device and
        host arrays), the outputs, the explicit mask's table and the sequence offsets."""
        with self._lock:
            if self._bufs is None:
                self._bufs = self._make_buffers()
            return self._bufs

    def _make_buffers(self) -> dict:
        """The buffers of :attr:`_buffers`."""
        if self._planned is None:
            raise InvalidArgumentError("this plan was made from layouts (ArraySpec): it has no arrays to encode")
        q, k, v, m = self._planned
        ops = self._planned_ops = self._operands(q, k, v, m, self._planned_sinks, self._planned_alibi)
        if self._upload:
            return self._uploaded(ops, self._output_buffers())
        dev = self.device
        b = self._tagged({name: None if op is None else dev.wrap(op, span=True) for name, op in zip(_Operands._fields, ops)})
        # The outputs are arrays of q's library, which encoded_result returns.
        oo = ops.q.new_empty(self.shape, self.out_dtype)
        lo = ops.q.new_empty(self.lse_shape, np.float32) if self._lse else None
        self._enc_out = (oo, lo)
        b.update(self._output_buffers(dev.wrap(oo, span=True), None if lo is None else dev.wrap(lo, span=True)))
        return b

    def _workspace_buffer(self):
        """A device buffer for the split's scratch of encoder runs, or None."""
        n = self._extents["workspace"]
        return self.device.empty((n,), np.uint8) if n else None

    def encode(self, encoder: Encoder, *, classify: bool = True) -> None:
        """Record a run on the planned arrays on ``encoder`` (an encoder of the plan's
        device; it runs on the library's stream when committed): the explicit mask's
        classification (unless ``classify`` is False and an earlier recording classified
        it into the plan's table), then the attention. The output is
        :meth:`encoded_result`'s, overwritten by every recorded run. A paged plan records
        with its block table and lengths (and classifies its mask on every recording)."""
        self._record(encoder, self._buffers, classify)

    def encoded_result(self) -> Any:
        """The output of the runs recorded by :meth:`encode` (after their commit): ``out``
        or ``(out, lse)``, arrays of q's library (the same arrays every time, except for
        host arrays on a CUDA device, which are downloaded anew)."""
        b = self._buffers
        if self._upload:
            return self._download(b, Operand.of(self._planned[0], "q"), None, None)
        oo, lo = self._enc_out
        return (oo.obj, lo.obj) if lo is not None else oo.obj

    def _record(self, enc: Encoder, b: dict, classify: bool) -> None:
        h = lambda x: 0 if x is None else x.handle  # noqa: E731
        if self._paged is not None or self._kv_format is not None:
            # The plan's own record (mlxn_prefill_plan_encode): it binds the block table and the
            # lengths it holds, and quantised K/V's format and descale factors, which the
            # buffer-level dispatch has no operand for. It classifies an explicit mask on every
            # recording (``classify`` is not read).
            check(lib.mlxn_prefill_plan_encode(self._handle, enc.handle, h(b["q"]), h(b["k"]), h(b["v"]), h(b["mask"]),
                                               h(b["out"]), h(b["lse"]), h(b.get("sinks")), h(b.get("alibi")),
                                               h(b.get("workspace"))))  # fmt: skip
            enc._hold(*[x for x in b.values() if x is not None])
            return
        # The plan's options on its own dispatches; the encoder's default for what follows.
        check(lib.mlxn_encoder_set_options(enc.handle, self._options[0]))
        try:
            self._record_dispatches(enc, b, classify, h)
        finally:
            check(lib.mlxn_encoder_set_options(enc.handle, ffi.NULL))
        enc._hold(*[x for x in b.values() if x is not None])

    def _record_dispatches(self, enc: Encoder, b: dict, classify: bool, h) -> None:
        if b["mask"] is not None and (classify or not self._classified):
            check(lib.mlxn_dispatch_flash_attn_prefill_mask_blk(enc.handle, b["mask"].handle, b["blk"].handle, self._params))
            self._classified = True
        check(
            lib.mlxn_dispatch_flash_attn_prefill(
                enc.handle,
                b["q"].handle,
                b["k"].handle,
                b["v"].handle,
                b["out"].handle,
                h(b["mask"]),
                h(b["blk"]),
                h(b["cu_q"]),
                h(b["cu_k"]),
                h(b["lse"]),
                h(b.get("sinks")),
                h(b.get("alibi")),
                h(b.get("workspace")),
                self._params,
            )
        )

    def _uploaded(self, ops: "_Operands", outputs: Optional[dict] = None) -> dict:
        """Encoder buffers of a run of host arrays on a CUDA device: copies of the operands
        uploaded, and the outputs, table and offsets (``outputs``, else those every such run
        of the plan shares, made once)."""
        if outputs is None:
            with self._lock:
                if self._scratch is None:
                    self._scratch = self._output_buffers()
            outputs = self._scratch
        b = dict(outputs)
        for name, op in zip(_Operands._fields, ops):
            b[name] = None if op is None else self.device.buffer(span(op))
        return self._tagged(b)

    def _tagged(self, b: dict) -> dict:
        """``b`` with quantised K/V's buffers of raw bytes (uint8, as bound or uploaded: Q8_0's
        always, FP8's given with ``kv_dtype``) as views of the format's dtype, the dtype the op
        checks quantised K/V's buffers against (float8 arrays carry theirs)."""
        if self._kv_format is not None:
            for name in ("k", "v"):
                if b[name].dtype == np.uint8:
                    b[name] = b[name].view(0, b[name].nbytes, self._kv_format)
        return b

    def _output_buffers(self, out: Any = None, lse: Any = None) -> dict:
        """Device buffers of the outputs (``out`` and ``lse`` where given, else new flat
        ones), of the explicit mask's table and of the sequence offsets, for runs through an
        encoder."""
        dev = self.device
        b = dict(out=out, lse=lse, blk=None, cu_q=None, cu_k=None)
        if out is None:
            b["out"] = dev.empty((self._extents["out"],), self.out_dtype)
        if lse is None and self._lse:
            b["lse"] = dev.empty((self._extents["lse"],), np.float32)
        if self._mask_form is not None:
            b["blk"] = dev.empty((max(1, self._extents["blk"]),), np.uint8)
        if self._cu is not None:
            b["cu_q"], b["cu_k"] = dev.buffer(self._cu[0]), dev.buffer(self._cu[1])
        b["workspace"] = self._workspace_buffer()
        return b

    def _run_buffers(self, b: dict, out, lse, qo: Operand):
        with self.device.encoder() as enc:
            self._record(enc, b, True)
        return self._download(b, qo, out, lse)

    def _download(self, b: dict, qo: Operand, out, lse):
        o = b["out"].numpy().reshape(self.shape)
        oo = output(out, qo, "out", self.shape, self.out_dtype, fill=o)
        if not self._lse:
            return oo.obj
        lo = output(lse, qo, "lse", self.lse_shape, np.float32, fill=b["lse"].numpy().reshape(self.lse_shape))
        return oo.obj, lo.obj


def _run(
    handle: int,
    q: int,
    k: int,
    v: int,
    mask: Optional[int],
    out: int,
    lse: Optional[int],
    stream: int,
    sinks: Optional[int] = None,
    workspace: Optional[int] = None,
    alibi: Optional[int] = None,
) -> None:
    """One ``mlxn_prefill_plan_run``. The C ABI reads address 0 of the mask, lse or sinks as
    "not given": an empty one (no element, so never read) takes the address of another
    operand, and when every operand is empty there is nothing to run. ``workspace`` None
    runs unsplit."""
    if mask == 0 or lse == 0 or sinks == 0 or alibi == 0:
        some = k or q or v or out
        if not some:
            return
        mask = some if mask == 0 else mask
        lse = some if lse == 0 else lse
        sinks = some if sinks == 0 else sinks
        alibi = some if alibi == 0 else alibi
    check(lib.mlxn_prefill_plan_run(handle, q, k, v, mask or 0, out, lse or 0, sinks or 0, alibi or 0, workspace or 0,
                                    stream))  # fmt: skip


class _Operands(NamedTuple):
    """The arrays of one run, bound to its plan (``PrefillPlan._operands``); the names are
    those of the encoder buffers they become."""

    q: Operand
    k: Operand
    v: Operand
    mask: Optional[Operand]
    sinks: Optional[Operand]
    alibi: Optional[Operand]


def _run_options(options: tuple) -> tuple:
    """The C ABI's ``MlxnRunOptions`` of ``(kv_splits, cta_pairs, cuda_form, cpu_isa)``
    (checked for their types by ``checked``), with the strings it points to, which must
    live as long as it is read."""
    kv_splits, *names = options
    o = ffi.new("MlxnRunOptions *")
    if kv_splits is not None:  # beyond int64 only to be refused, by its value, by the library
        o.has_kv_splits, o.kv_splits = 1, min(max(kv_splits, -(2**63)), 2**63 - 1)
    # surrogatepass: a name that is not UTF-8 reaches the library, which refuses it by name.
    held = [None if n is None else ffi.new("char[]", n.encode("utf-8", "surrogatepass")) for n in names]
    o.cta_pairs, o.cuda_form, o.cpu_isa = (ffi.NULL if c is None else c for c in held)
    return (o, held)


def _descale_struct(k: Optional[np.ndarray], v: Optional[np.ndarray]) -> tuple:
    """The C ABI's ``MlxnKvDescale`` of FP8's factors (float32 host arrays, or None each),
    with the arrays it points to (which must live as long as it is read); NULL for none."""
    if k is None and v is None:
        return (ffi.NULL, None)
    d = ffi.new("MlxnKvDescale *")
    held = [None if x is None else ffi.from_buffer("float[]", x) for x in (k, v)]
    d.k, d.k_len = (ffi.NULL, 0) if k is None else (held[0], k.size)
    d.v, d.v_len = (ffi.NULL, 0) if v is None else (held[1], v.size)
    return (d, (held, k, v))


def _ptr(op: Optional[Operand]) -> Optional[int]:
    return None if op is None else op.ptr


def _obj(op: Optional[Operand]) -> Any:
    return None if op is None else op.obj
