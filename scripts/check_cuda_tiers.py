"""Check the KV tiers' device paths on a real device: the script to run when a GPU is lent.

    python -m scripts.check_cuda_tiers                 # CUDA (the point of it)
    python -m scripts.check_cuda_tiers --device cpu    # the same checks on CPU (a smoke test)

1. The host buffer is pinned with one registration (``cudaHostRegister``) when on CUDA.
2. Spill -> the compute stream overwrites the spilled blocks right after ``wait_device_reads`` ->
   restore into other blocks: the bytes equal the originals (the copy stream and the compute
   stream are ordered by events, not by luck).
3. A flipped byte in a host slot fails the restore's checksum; with host hashing the block is left
   alone, with device hashing (CuPy) the bad bytes land in the fresh block, which is not used.
4. Tier copy bandwidth vs a plain ``copy_`` between the same pinned host memory and the device,
   through the staging buffer (``kv/tiers/block_staging.py``; on CPU too, so the smoke run takes
   the CUDA path's code): a batch of consecutive slots costs one gather or scatter kernel and one
   copy per chunk of the staging buffer's blocks.
5. The engine with host and disk tiers on a tiny random Llama equals ``transformers`` greedy.

Prints one line per check and, last, one JSON object; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Tuple


import torch  # noqa: E402

from kv.tiers.host_buffer import HostBuffer  # noqa: E402
from kv.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from kv.tiers.ops import OpStatus, Restore, Spill  # noqa: E402
from kv.tiers.transfer import TransferEngine  # noqa: E402


def check_copies(device: torch.device, num_blocks: int, repeats: int = 3) -> dict:
    """The tier copy path on ``num_blocks`` blocks: a first round checked for correctness (the
    bytes come back; it also warms the copy stream, the pinned buffer and the checksum up), then
    ``repeats`` timed round trips (best of each direction, checked again), a flipped host byte,
    and a plain ``copy_`` of the same bytes each way (best of ``repeats``) as the baseline.
    Copies go through the staging buffer; the kernels and copies of the first round's spill and
    restore are counted."""
    spec = KVCacheSpec(30, 2 * num_blocks, 16, 3, 64, torch.float32)
    kv = KVCache(spec, device)
    kv.data.normal_()
    host = HostBuffer(num_blocks, spec.bytes_per_block, pin=device.type == "cuda")
    # A stuck copy fails in a minute, well inside a lent machine's time, not in ten.
    transfer = TransferEngine(kv, host, wait_timeout_s=60.0, staged=True)
    staging = transfer.staging
    bs = spec.block_size
    low, high = slice(0, num_blocks * bs), slice(num_blocks * bs, 2 * num_blocks * bs)
    originals = kv.data[:, :, low].cpu().clone()
    try:
        counted = _counts(staging)
        spill = _spill(transfer, range(num_blocks))
        spill_counts, counted = _counts(staging, counted), _counts(staging)
        kv.data[:, :, low].zero_()  # compute reusing the blocks at once
        transfer.submit([Restore(b, num_blocks + b, tag=b) for b in range(num_blocks)])
        restore = transfer.agree(None, wait=True)
        restore_counts = _counts(staging, counted)
        restore_equal = (all(s == OpStatus.OK for s in restore.statuses)
                         and torch.equal(kv.data[:, :, high].cpu(), originals))
        spill_s, restore_s, timed_equal = _timed_round_trips(transfer, kv, num_blocks, repeats,
                                                             originals)
        kv.data[:, :, :bs].zero_()
        host.slot(0)[123] ^= 0xFF
        transfer.submit([Restore(0, 0, tag=0)])
        corrupt = transfer.agree(None, wait=True)
        # Block 0 is left alone where the host checks before copying (staged, without CuPy);
        # device hashing copies first, and the failed block is not attended to.
        checks_first = transfer.checksum.device is None
        corruption_caught = (corrupt.statuses == (OpStatus.CHECKSUM,)
                             and (not checks_first or not kv.data[:, :, :bs].any().item()))
        plain_d2h_s, plain_h2d_s = (_plain_copy_s(host, kv, num_blocks, to_host, repeats)
                                    for to_host in (True, False))
    finally:
        transfer.close()
        pinned = host.is_pinned
        host.close()
    nbytes = num_blocks * spec.bytes_per_block
    num_chunks = -(-num_blocks // staging.capacity)  # 4 KiB-multiple blocks: a run per chunk
    return {
        "pinned": pinned, "checksum": transfer.checksum.name,
        "checksum_on_device": transfer.checksum.device is not None,
        "spill_ok": all(s == OpStatus.OK for s in spill.statuses),
        "restore_equal": restore_equal and timed_equal,
        "corruption_caught": corruption_caught,
        "d2h_gbps": nbytes / spill_s / 1e9, "h2d_gbps": nbytes / restore_s / 1e9,
        "plain_d2h_gbps": nbytes / plain_d2h_s / 1e9,
        "plain_copy_gbps": nbytes / plain_h2d_s / 1e9,  # host to device, as restores go
        "staging_blocks": staging.capacity, "staging_mib": staging.nbytes / (1 << 20),
        "spill_kernels": spill_counts[0], "spill_copies": spill_counts[1],
        "restore_kernels": restore_counts[0], "restore_copies": restore_counts[1],
        "batched": spill_counts == restore_counts == (num_chunks, num_chunks),
    }


def _counts(staging, since: Tuple[int, int] = (0, 0)) -> Tuple[int, int]:
    """Gather/scatter kernels and host copies the staging buffer queued, minus ``since``."""
    return staging.num_kernels - since[0], staging.num_copies - since[1]


def _spill(transfer: TransferEngine, blocks: Iterable[int]):
    """Spill ``blocks`` to host slots 0, 1, ... (tagged by slot); the agreed result."""
    transfer.submit([Spill(b, i, tag=i) for i, b in enumerate(blocks)])
    transfer.wait_device_reads()
    return transfer.agree(None, wait=True)


def _timed_round_trips(transfer: TransferEngine, kv: KVCache, num_blocks: int, repeats: int,
                       originals: torch.Tensor) -> Tuple[float, float, bool]:
    """Best seconds of ``repeats`` spills of the high blocks (the first round's restored copy)
    and restores into the low ones; whether every round trip came back equal."""
    bs = kv.spec.block_size
    spill_s = restore_s = float("inf")
    equal = True
    for _ in range(repeats):
        started = time.perf_counter()
        spill = _spill(transfer, range(num_blocks, 2 * num_blocks))
        spill_s = min(spill_s, time.perf_counter() - started)
        kv.data[:, :, :num_blocks * bs].zero_()
        started = time.perf_counter()
        transfer.submit([Restore(b, b, tag=b) for b in range(num_blocks)])
        restore = transfer.agree(None, wait=True)
        restore_s = min(restore_s, time.perf_counter() - started)
        equal = equal and all(s == OpStatus.OK for s in spill.statuses + restore.statuses) and (
            torch.equal(kv.data[:, :, :num_blocks * bs].cpu(), originals))
    return spill_s, restore_s, equal


def _plain_copy_s(host: HostBuffer, kv: KVCache, num_blocks: int, to_host: bool,
                  repeats: int) -> float:
    """Best seconds of one ``copy_`` of the spilled bytes between the pool and the host buffer,
    after an untimed one."""
    host_bytes = host.data[:num_blocks].view(-1)
    pool_bytes = kv.data.view(torch.uint8).view(-1)[:host_bytes.numel()]
    dst, src = (host_bytes, pool_bytes) if to_host else (pool_bytes, host_bytes)
    best = float("inf")
    for round_ in range(repeats + 1):
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if kv.data.is_cuda:
            torch.cuda.synchronize()
        if round_:
            best = min(best, time.perf_counter() - started)
    return best


def check_engine(device: str) -> dict:
    import transformers
    from workers.config import EngineConfig
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        config = transformers.LlamaConfig(vocab_size=509, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=256,
                                          initializer_range=0.2)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        model.save_pretrained(str(model_dir))
        prompts = [[7 + (i * 13 + j) % 400 for j in range(28)] + [i + 3] for i in range(6)]
        reference = []
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                 max_new_tokens=8, do_sample=False, pad_token_id=0)
            reference.append(out[0, len(ids):].tolist())
        engine_config = EngineConfig(model=str(model_dir), device=device, dtype="float32",
                                     block_size=4, num_kv_blocks=16, max_num_seqs=1,
                                     host_kv_blocks=6, disk_kv_dir=str(Path(tmp) / "kv"),
                                     disk_kv_blocks=64)
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        with LLM(engine_config) as llm:
            got = [o.output_token_ids for o in llm.generate(prompts + prompts, greedy)]
            stats = llm.engine.kv_tier_stats()
    return {"engine_equal": got == reference + reference,
            "engine_restored_bytes": stats["kv_tier_restored_bytes_total"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--blocks", type=int, default=64, help="blocks per copy batch")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; pass --device cpu for the CPU smoke run",
              file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              **check_copies(torch.device(args.device), args.blocks),
              **check_engine(args.device)}
    checks = ["spill_ok", "restore_equal", "corruption_caught", "batched", "engine_equal"]
    if args.device == "cuda":
        checks.insert(0, "pinned")
    for name in checks:
        print(f"{name}: {'ok' if result[name] else 'FAILED'}")
    print(f"checksum: {result['checksum']} "
          f"({'on the device' if result['checksum_on_device'] else 'on the host'})")
    print(f"staging {result['staging_blocks']} blocks ({result['staging_mib']:.1f} MiB); a batch "
          f"of {args.blocks}: spill {result['spill_kernels']} kernels + "
          f"{result['spill_copies']} copies, restore {result['restore_copies']} copies + "
          f"{result['restore_kernels']} kernels")
    print(f"tier d2h {result['d2h_gbps']:.2f} GB/s, h2d {result['h2d_gbps']:.2f} GB/s; "
          f"plain copy_ d2h {result['plain_d2h_gbps']:.2f} GB/s, h2d "
          f"{result['plain_copy_gbps']:.2f} GB/s")
    print(json.dumps(result))
    return 0 if all(result[name] for name in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
