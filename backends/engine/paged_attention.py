"""Paged KV cache in block tensors, and attention over it with torch SDPA.

The cache is one tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; a sequence's
keys live in the blocks its block table names, position ``p`` at slot
``block_table[p // block_size] * block_size + p % block_size``. Each step:

- ``build_layout`` turns the step's sequences into index tensors once (token slots, positions, a
  padded block table for the single-query rows, masks), shared by every layer;
- every layer writes its new K/V with one ``index_copy_`` over all tokens, then attends:
  * all single-query rows (decodes) together in one SDPA call: their blocks gathered into a padded
    ``[B, kv_heads, L, D]`` view with a key-padding mask; the query heads of a KV group are laid
    along the query axis, so grouped-query attention needs no expanded K/V copy;
  * each multi-token chunk (prefill) on its own: a first chunk attends to its fresh K/V with
    ``is_causal`` (flash-eligible); a later chunk gathers its prefix from the cache and uses a
    bottom-right-aligned causal mask (SDPA's ``is_causal`` aligns top-left, wrong when queries are
    the tail of the keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elt = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elt

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V block tensors of layer ``i``: ``[num_blocks, block_size, kv_heads, head_dim]``."""
        return self.data[i, 0], self.data[i, 1]


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """A multi-token chunk of one sequence: rows ``row_start:row_end`` of the step's flat batch."""

    row_start: int
    row_end: int
    start_pos: int
    kv_len: int  # start_pos + len
    block_ids: torch.Tensor | None  # blocks covering positions [0, kv_len); None if no prefix
    mask: torch.Tensor | None  # [len, start_pos + len] bool, True = may attend; None if no prefix


@dataclass(frozen=True, slots=True)
class StepLayout:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat cache slot of each token's K/V
    single_rows: torch.Tensor | None  # [B] rows of single-query sequences
    single_blocks: torch.Tensor | None  # [B, nb] block tables, padded with block 0
    single_mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] key padding, True = valid
    chunks: tuple[ChunkSpan, ...]
    sample_rows: torch.Tensor  # [S] last row of each sequence that samples, in input order


@dataclass(frozen=True, slots=True)
class SeqInput:
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    sample: bool


def build_layout(seqs: Sequence[SeqInput], *, block_size: int, device: torch.device) -> StepLayout:
    """Index tensors for one step. Built on the host and copied to the device in one transfer."""
    n = len(seqs)
    q_lens = [len(s.token_ids) for s in seqs]
    starts = [s.start_pos for s in seqs]
    for s, q in zip(seqs, q_lens, strict=True):
        if q == 0:
            raise ValueError("a sequence in a step must carry at least one token")
        if len(s.block_table) * block_size < s.start_pos + q:
            raise ValueError(
                f"block table of {len(s.block_table)} blocks cannot hold {s.start_pos + q} tokens "
                f"(block size {block_size})"
            )
    total = sum(q_lens)
    max_blocks = max(len(s.block_table) for s in seqs)
    # Padded with block 0: padding is never read unmasked.
    table = torch.tensor([[*s.block_table, *[0] * (max_blocks - len(s.block_table))] for s in seqs])
    q_len_t = torch.tensor(q_lens, dtype=torch.long)
    ends = torch.cumsum(q_len_t, 0)
    seq_of_row = torch.repeat_interleave(torch.arange(n), q_len_t)
    positions = torch.tensor(starts, dtype=torch.long)[seq_of_row] + (
        torch.arange(total) - (ends - q_len_t)[seq_of_row]
    )
    slots = table[seq_of_row, positions // block_size] * block_size + positions % block_size
    tokens = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long)
    kv_lens = torch.tensor([st + q for st, q in zip(starts, q_lens, strict=True)], dtype=torch.long)

    single = [i for i in range(n) if q_lens[i] == 1]
    single_t = torch.tensor(single, dtype=torch.long)
    sample_t = torch.tensor([int(ends[i]) - 1 for i in range(n) if seqs[i].sample], dtype=torch.long)
    # One host->device copy for everything, then views.
    parts = [tokens, positions, slots, table.flatten(), kv_lens, single_t, (ends - 1)[single_t], sample_t]
    flat = torch.cat(parts).to(device, non_blocking=True)
    pieces = flat.split([p.numel() for p in parts])
    d_tokens, d_pos, d_slots, d_table_flat, d_kv_lens, d_single, d_single_rows, d_sample = pieces
    d_table = d_table_flat.view(n, max_blocks)

    single_blocks = single_mask = single_rows = None
    if single:
        nb = max(-(-(starts[i] + 1) // block_size) for i in single)
        single_blocks = d_table[d_single, :nb]
        key_pos = torch.arange(nb * block_size, device=device)
        single_mask = (key_pos[None, :] < d_kv_lens[d_single][:, None])[:, None, None, :]
        single_rows = d_single_rows

    chunks = []
    row = 0
    for i, (q, st) in enumerate(zip(q_lens, starts, strict=True)):
        if q > 1:
            block_ids = mask = None
            if st > 0:
                kv_len = st + q
                block_ids = d_table[i, : -(-kv_len // block_size)]
                # Query j (position st + j) sees keys 0..st + j: the causal diagonal aligned bottom-right.
                mask = torch.ones((q, kv_len), dtype=torch.bool, device=device).tril_(diagonal=st)
            chunks.append(ChunkSpan(row, row + q, st, st + q, block_ids, mask))
        row += q
    return StepLayout(
        token_ids=d_tokens,
        positions=d_pos,
        slots=d_slots,
        single_rows=single_rows,
        single_blocks=single_blocks,
        single_mask=single_mask,
        chunks=tuple(chunks),
        sample_rows=d_sample,
    )


def write_kv(cache: PagedKVCache, layer: int, layout: StepLayout, k: torch.Tensor, v: torch.Tensor) -> None:
    k_cache, v_cache = cache.layer(layer)
    flat_shape = (-1, *k_cache.shape[2:])
    k_cache.view(flat_shape).index_copy_(0, layout.slots, k)
    v_cache.view(flat_shape).index_copy_(0, layout.slots, v)


def _gather_blocks(blocks: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[nb] block ids -> [nb * block_size, kv_heads, head_dim] (one sequence's keys in order)."""
    g = blocks.index_select(0, block_ids)
    return g.view(-1, *g.shape[2:])


def paged_attention(
    cache: PagedKVCache, layer: int, layout: StepLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Writes this step's K/V for ``layer`` into the cache and attends. q [T, Hq, D], k/v [T, Hkv, D]."""
    write_kv(cache, layer, layout, k, v)
    k_cache, v_cache = cache.layer(layer)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k.shape[1]
    group = num_heads // num_kv
    out = torch.empty_like(q)

    if layout.single_rows is not None:
        assert layout.single_blocks is not None and layout.single_mask is not None
        b = layout.single_blocks.shape[0]
        # [B, nb, bs, Hkv, D] -> [B, Hkv, nb*bs, D]
        ks = k_cache[layout.single_blocks].view(b, -1, num_kv, head_dim).transpose(1, 2)
        vs = v_cache[layout.single_blocks].view(b, -1, num_kv, head_dim).transpose(1, 2)
        # Heads of one KV group ride on the query axis: [B, Hq, D] -> [B, Hkv, group, D].
        qs = q.index_select(0, layout.single_rows).view(b, num_kv, group, head_dim)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=layout.single_mask)
        out.index_copy_(0, layout.single_rows, o.reshape(b, num_heads, head_dim))

    for span in layout.chunks:
        qc = q[span.row_start : span.row_end]
        if span.block_ids is None:
            kc, vc = k[span.row_start : span.row_end], v[span.row_start : span.row_end]
        else:
            kc = _gather_blocks(k_cache, span.block_ids)[: span.kv_len]
            vc = _gather_blocks(v_cache, span.block_ids)[: span.kv_len]
        out[span.row_start : span.row_end] = chunk_attention(qc, kc, vc, span.mask)
    return out


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """One sequence's chunk: q [L, Hq, D] against k/v [S, Hkv, D] (S >= L, the chunk is the tail).

    ``mask`` None means S == L and plain causal attention (flash-eligible).
    """
    group = q.shape[1] // k.shape[1]
    # Explicitly expanded KV heads: SDPA's enable_gqa is not taken by every fused backend, and the
    # unfused fallback would materialise a [heads, L, S] score matrix. Inputs are 4-D because the
    # fused CUDA kernels reject 3-D ones.
    qx = q.transpose(0, 1).unsqueeze(0)
    kx = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    vx = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    if mask is None:
        o = F.scaled_dot_product_attention(qx, kx, vx, is_causal=True)
    else:
        o = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask)
    return o[0].transpose(0, 1)
