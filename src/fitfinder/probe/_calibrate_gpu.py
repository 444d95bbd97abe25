"""`fitfinder calibrate`'s measurement, run as its own short process: `python _calibrate_gpu.py INDEX`.

It prints exactly one JSON line, {"ok": false, "error"} or {"ok": true, ...} with the raw numbers
overhead.from_measurement turns into the overhead model:

1. `used_before_bytes`: what the card has in use before this process makes a context (NVML,
   which makes none): the display, the driver, other processes.
2. A context, then a first bf16 matrix product: `allocated_before_matmul_bytes`,
   `allocated_after_matmul_bytes`, `matmul_output_bytes` (the difference beyond the output is the
   cuBLAS workspace PyTorch allocates and keeps); then the attention kernels, as the cuda meter
   warms up.
3. A training-like workload (frozen bf16 MLP blocks with a trainable low-rank adapter each,
   AdamW, three sequence lengths in turn like buckets, about 4 GiB): its peak allocated and
   peak reserved bytes give the allocator's fragmentation. After it, `used_after_bytes` less
   `reserved_bytes` (and less what was in use before) is the context with its libraries.

Only the standard library, NVML and torch are imported.
"""

import json
import sys


def _used_bytes(index: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    finally:
        pynvml.nvmlShutdown()


def _workload(torch, device) -> tuple[int, int]:
    """Peak allocated and reserved bytes of a few training steps with changing shapes."""
    width, hidden, rank, blocks = 3072, 12288, 16, 8
    weights = [(torch.randn(hidden, width, device=device, dtype=torch.bfloat16) * 0.02,
                torch.randn(width, hidden, device=device, dtype=torch.bfloat16) * 0.02) for _ in range(blocks)]
    adapters = [(torch.zeros(rank, width, device=device, dtype=torch.bfloat16, requires_grad=True),
                 torch.zeros(width, rank, device=device, dtype=torch.bfloat16, requires_grad=True))
                for _ in range(blocks)]
    optimizer = torch.optim.AdamW([p for pair in adapters for p in pair], lr=1e-4)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    for tokens in (1024, 4096, 2304, 4096, 1024, 4096):
        x = torch.randn(1, tokens, width, device=device, dtype=torch.bfloat16)
        for (up, down), (a, b) in zip(weights, adapters):
            h = torch.nn.functional.gelu(x @ up.t())
            x = x + h @ down.t() + (x @ a.t()) @ b.t()
        x.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del x, h
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def measure(index: int) -> dict:
    used_before = _used_bytes(index)
    import torch

    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    a = torch.ones(256, 256, device=device, dtype=torch.bfloat16)
    b = torch.ones(256, 256, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    c = a @ b
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    q = a.view(1, 1, 256, 256)
    torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().item()
    del q
    peak_allocated, peak_reserved = _workload(torch, device)
    # After the workload every library it needs is loaded, as in a probe; what the card lost
    # beyond PyTorch's segments is the context and those libraries.
    torch.cuda.synchronize(device)
    reserved = torch.cuda.memory_reserved(device)
    used_after = _used_bytes(index)
    return {"ok": True, "gpu_name": torch.cuda.get_device_name(device),
            "total_bytes": int(torch.cuda.get_device_properties(device).total_memory),
            "used_before_bytes": used_before, "used_after_bytes": used_after, "reserved_bytes": int(reserved),
            "allocated_before_matmul_bytes": int(before), "allocated_after_matmul_bytes": int(after),
            "matmul_output_bytes": int(c.untyped_storage().nbytes()),
            "workload_peak_allocated_bytes": int(peak_allocated), "workload_peak_reserved_bytes": int(peak_reserved),
            "torch": torch.__version__, "cuda": torch.version.cuda}


def main() -> None:
    try:
        answer = measure(int(sys.argv[1]))
    except Exception as exc:  # noqa: BLE001 - every failure is the answer
        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}".strip()[:2000]}
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
