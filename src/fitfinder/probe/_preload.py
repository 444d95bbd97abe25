"""Imported once by the probe forkserver, so that every probe forked from it starts warm.

Only imports: no tensor is made and no GPU is touched here, which keeps forking safe.
Library banners printed while importing (bitsandbytes has one) go to /dev/null.

The collector is off while importing: the libraries make some 930,000 objects and little
garbage, yet the automatic collector ran eight full collections over them as they grew, about a
sixth of the imports' time (6.2 -> 5.0 s, benchmarks/import_gc.py). The cyclic garbage they
leave (some 15,000 objects, 10 MiB) is frozen with the rest: collecting it first would cost
0.6 s, more than it is worth.
"""

import gc
import os

_collecting = gc.isenabled()
gc.disable()
_stderr = os.dup(2)
_null = os.open(os.devnull, os.O_WRONLY)
os.dup2(_null, 2)
try:
    import torch  # noqa: F401
    import diffusers  # noqa: F401
    from diffusers import (AutoencoderKL, AutoencoderKLWan, FluxTransformer2DModel,  # noqa: F401
                           UNet2DConditionModel, WanTransformer3DModel)
    from transformers import (CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel,  # noqa: F401
                              UMT5EncoderModel)
    import bitsandbytes  # noqa: F401
    import optimum.quanto  # noqa: F401  (the probes quantize with it)
    # Imported by quanto's first 8-bit quantize (WeightQBytesTensor.create), which makes two
    # module-level index tensors (marlin's int4 permutations) as it imports: imported inside a
    # meter they would count as device memory of the first probe or estimate in this process.
    import optimum.quanto.tensor.weights.marlin  # noqa: F401
    import peft  # noqa: F401
    import peft.tuners.lora  # noqa: F401

    import fitfinder.models  # noqa: F401
    import fitfinder.models._pipeline  # noqa: F401
    import fitfinder.oom  # noqa: F401
    import fitfinder.probe.meters  # noqa: F401
    import fitfinder.probe.recipe  # noqa: F401

    # The libraries' objects live as long as the process: frozen, no collection scans them
    # again. The estimate's first collection (estimate.InProcess.run) took 0.27 s scanning them
    # (benchmarks/fake_dispatch.py).
    gc.freeze()
finally:
    os.dup2(_stderr, 2)
    os.close(_null)
    os.close(_stderr)
    if _collecting:
        gc.enable()
