"""Does a P5-like step overlap its memory-bound decodes with its compute-bound prompt work when the
two run side by side on disjoint sets of SMs (green contexts)? Issue 15's P5 question, a probe.

Two streams running free (docs/perf.md 17) time-shared the SMs: a cuBLAS GEMM's CTAs hold whole
SMs and the attention launch's programs fill every SM, so neither could use what the other left.
Here the device's SMs are split into two green contexts (``bench/sm_partition.py``) and
each half of a mixed step runs a whole "model" of ``--layers`` layers on its own partition:

- decodes (``--decodes`` sequences at P5's contexts): per layer the four Qwen3-0.6B GEMMs at
  M = decodes and the item-queue decode attention, its grid sized to the partition;
- prompt chunks (``--prompt-tokens`` of P5-like prompts): per layer the four GEMMs at that M
  (cuBLASLt told the partition's SM count) and the paged prefill attention.

Rows (bench "sm_partition", microseconds a layer, CUDA events around 10 repeats): the engine's way
(one stream, all SMs, the GEMMs over decodes and prompt rows together, then both attentions), each
half alone on the full device, and for every split each half alone on its partition and both side by
side (the GEMMs told their partition's SM count, and not). The split pays where "both" beats the
engine's row. Usage:
    python bench/sm_partition_probe.py [--prompt-tokens 8192] [--decodes 256] [--layers 8]
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]
from gpu_timing import _provenance, _time_events  # noqa: E402
from kernels_bench import attention_arguments, decode_batch, protocol_contexts  # noqa: E402
from prefill_step_bench import checked_rel_err, p5_step, step_batch  # noqa: E402
from tokenmill.kernels.reference import paged_attention_ref  # noqa: E402
from sm_partition import split_device  # noqa: E402

HIDDEN, INTER, QKV_OUT, ATTN_OUT = 1024, 3072, 4096, 2048  # Qwen3-0.6B: 16 + 2 x 8 heads of 128


@contextlib.contextmanager
def gemm_sms(count: int | None) -> Iterator[None]:
    """cuBLASLt's GEMMs sized for ``count`` SMs (None: the whole device) while the block runs."""
    total = torch.cuda.get_device_properties(0).multi_processor_count
    torch._C._set_sm_carveout_experimental(None if count is None else total - count)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)


class Layers:
    """One half's per-layer work: the four GEMMs over ``rows`` tokens and its attention call."""

    def __init__(self, rows: int, attention: Callable[[], Any], weights: dict[str, torch.Tensor]) -> None:
        self.attention, self.weights = attention, weights
        self.inputs = {k: torch.randn(rows, w.shape[1], device="cuda", dtype=w.dtype) for k, w in weights.items()}
        self.outputs = {k: torch.empty(rows, w.shape[0], device="cuda", dtype=w.dtype) for k, w in weights.items()}

    def gemms(self) -> None:
        for name, weight in self.weights.items():
            torch.mm(self.inputs[name], weight.t(), out=self.outputs[name])


def time_us(fn: Callable[[], None], layers: int) -> float:
    """Median microseconds a layer of ``fn`` (which runs all layers): CUDA events on the current stream."""
    return _time_events(fn, calls=1)[0] / layers


def on_streams(parts: list[tuple[torch.cuda.Stream, Callable[[], None]]]) -> None:
    """Each part on its stream, all forked from and joined back to the current stream."""
    main = torch.cuda.current_stream()
    for stream, part in parts:
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            part()
    for stream, _ in parts:
        main.wait_stream(stream)


def main() -> None:
    parser = attention_arguments(__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--decodes", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--splits", default="16,24,32,40,48,64", help="SMs given to the decodes, comma-separated")
    parser.add_argument("--cache-dtype", default=None)
    args = parser.parse_args()
    from tokenmill.kernels.triton import paged_attention as pa
    from tokenmill.kernels.triton.paged_attention_queue import decode_order, launch_shape, new_queue, queued_decode_attention

    dtype = getattr(torch, args.dtype)
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count
    scale = args.head_dim**-0.5
    weights = {name: torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for name, (n, k) in
               {"qkv": (QKV_OUT, HIDDEN), "o": (HIDDEN, ATTN_OUT), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}.items()}

    decode_lens = protocol_contexts("prefill", args.decodes)[: args.decodes]
    dec = decode_batch(args, decode_lens)
    dec_q = dec.q[: len(decode_lens)]
    dec_out = torch.full_like(dec_q, float("nan"))
    order, queue = decode_order(dec.seq_lens), new_queue(dec_q.device)
    tile_n, warps, stages, per_sm = launch_shape(dtype, dec.kv_cache.dtype, args.head_dim)
    decode_programs = {"n": total_sms * per_sm}

    def decode_attention() -> None:
        queued_decode_attention(dec_q, dec.kv_cache, dec.seq_lens, dec.block_tables, scale, order, queue, out=dec_out,
                                tile_n=tile_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm,
                                programs=decode_programs["n"])

    prompt_q, prompt_s = p5_step(random.Random(5), tokens=args.prompt_tokens)
    pre, _, pre_config = step_batch(args, prompt_q, prompt_s, 0)
    pre_out = torch.full_like(pre.q, float("nan"))

    def prompt_attention() -> None:
        pa.paged_attention(pre.q, pre.kv_cache, pre.query_start_loc, pre.seq_lens, pre.block_tables, scale,
                           max_query_len=max(prompt_q), max_seq_len=max(prompt_s), num_decode_seqs=0, out=pre_out,
                           config=pre_config)

    decode_attention()
    prompt_attention()
    torch.cuda.synchronize()
    want_dec = paged_attention_ref(dec_q, dec.kv_cache, dec.query_start_loc, dec.seq_lens, dec.block_tables, scale)
    want_pre = paged_attention_ref(pre.q, pre.kv_cache, pre.query_start_loc, pre.seq_lens, pre.block_tables, scale)
    checked_rel_err(dec_out, want_dec, "decode attention")
    checked_rel_err(pre_out, want_pre, "prompt attention")

    decodes = Layers(len(decode_lens), decode_attention, weights)
    prompts = Layers(args.prompt_tokens, prompt_attention, weights)
    together = Layers(len(decode_lens) + args.prompt_tokens, lambda: None, weights)
    layers = args.layers

    def half(part: Layers, sms: int | None) -> Callable[[], None]:
        def run() -> None:
            for _ in range(layers):
                with gemm_sms(sms):
                    part.gemms()
                part.attention()
        return run

    def engine() -> None:  # the engine's mixed step: one GEMM over all rows, the two attention launches
        for _ in range(layers):
            together.gemms()
            prompt_attention()
            decode_attention()

    base = {**_provenance("sm_partition", ""), "prompt_tokens": args.prompt_tokens, "decodes": len(decode_lens),
            "decode_ctx_mean": round(sum(decode_lens) / len(decode_lens), 1), "layers": layers, "sms": total_sms,
            "decode_kv_gb_a_layer": round(sum(decode_lens) * args.kv_heads * args.head_dim * 2 * dec.kv_cache.element_size() / 1e9, 3)}
    engine_us = time_us(engine, layers)  # cuBLAS, as the engine runs
    print(json.dumps({**base, "case": "engine", "us_a_layer": round(engine_us, 1)}), flush=True)
    # The SM count target is a cuBLASLt attribute: the rest runs on cuBLASLt, its engine row first.
    torch.backends.cuda.preferred_blas_library("cublaslt")
    print(json.dumps({**base, "case": "engine-cublaslt", "us_a_layer": round(time_us(engine, layers), 1)}), flush=True)
    full = {name: time_us(half(part, None), layers) for name, part in (("decodes", decodes), ("prompts", prompts))}
    print(json.dumps({**base, "case": "halves-full-device", "decodes_us": round(full["decodes"], 1),
                      "prompts_us": round(full["prompts"], 1), "sum_us": round(sum(full.values()), 1)}), flush=True)
    plain = [torch.cuda.Stream(), torch.cuda.Stream()]
    both_plain = time_us(lambda: on_streams([(plain[0], half(decodes, None)), (plain[1], half(prompts, None))]), layers)
    print(json.dumps({**base, "case": "two-plain-streams", "us_a_layer": round(both_plain, 1),
                      "vs_engine": round(both_plain / engine_us, 3)}), flush=True)
    for split in (int(s) for s in args.splits.split(",")):
        try:
            partition = split_device(split, torch.device("cuda", torch.cuda.current_device()))
            (dec_stream, pre_stream), (dec_sms, pre_sms) = partition.streams, partition.sms
        except (RuntimeError, OSError, AttributeError) as exc:
            print(json.dumps({**base, "case": "split", "decode_sms": split, "error": repr(exc)[:300]}), flush=True)
            break
        decode_programs["n"] = dec_sms * per_sm
        run_dec, run_pre = half(decodes, dec_sms), half(prompts, pre_sms)
        try:
            alone_dec = time_us(lambda: on_streams([(dec_stream, run_dec)]), layers)
            alone_pre = time_us(lambda: on_streams([(pre_stream, run_pre)]), layers)
            both = time_us(lambda: on_streams([(dec_stream, run_dec), (pre_stream, run_pre)]), layers)
            # The GEMMs sized for the whole device (no SM count target): waves cut short on a partition.
            run_dec_full, run_pre_full = half(decodes, None), half(prompts, None)
            both_untold = time_us(lambda: on_streams([(dec_stream, run_dec_full), (pre_stream, run_pre_full)]), layers)
            torch.cuda.synchronize()  # what the last partitioned run wrote, checked (a wrong result stops the probe)
            dec_out.fill_(float("nan")), pre_out.fill_(float("nan"))
            on_streams([(dec_stream, run_dec), (pre_stream, run_pre)])
            torch.cuda.synchronize()
            checked_rel_err(dec_out, want_dec, f"decode attention on {dec_sms} SMs")
            checked_rel_err(pre_out, want_pre, f"prompt attention on {pre_sms} SMs")
            row = {"decodes_alone_us": round(alone_dec, 1), "prompts_alone_us": round(alone_pre, 1),
                   "both_us": round(both, 1), "vs_engine": round(both / engine_us, 3),
                   "both_gemms_untold_us": round(both_untold, 1),
                   "overlap_loss": round(both / max(alone_dec, alone_pre), 3)}
        except Exception as exc:  # noqa: BLE001  (a launch a green stream refuses: report it, go on)
            row = {"error": repr(exc)[:300]}
        decode_programs["n"] = total_sms * per_sm
        print(json.dumps({**base, "case": "split", "decode_sms": dec_sms, "prompt_sms": pre_sms, **row}), flush=True)


if __name__ == "__main__":
    main()
