"""The preflight's allocation test, run as its own short process: `python _alloc_check.py INDEX BYTES`.

It makes a CUDA context on the card, allocates BYTES, and runs one matrix product (which creates
the cuBLAS handle, the allocation that fails as CUBLAS_STATUS_ALLOC_FAILED on a sick card), then
prints exactly one JSON line: {"ok": true, "free_bytes", "total_bytes"} or {"ok": false, "error"}.
Only the standard library and torch are imported, so the parent needs no fitfinder on this path,
and the search process itself never holds a CUDA context.
"""

import json
import sys


def main() -> None:
    index, nbytes = int(sys.argv[1]), int(sys.argv[2])
    try:
        import torch

        device = torch.device("cuda", index)
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        block.fill_(1)
        matrix = torch.ones(256, 256, device=device)
        (matrix @ matrix).sum().item()  # synchronizes: an asynchronous CUDA error surfaces here
        free, total = torch.cuda.mem_get_info(device)
        answer = {"ok": True, "free_bytes": int(free), "total_bytes": int(total)}
    except Exception as exc:  # noqa: BLE001 - every failure is the answer
        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}".strip()[:2000]}
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
