"""What a trainer probe needs from a trainer's own format, and AI Toolkit's.

A trainer probe (probe/trainer.py) runs the user's trainer on a point. It needs, per trainer, one
`TrainerDialect`:

- `document(job)`: the point's job as plain data (JSON), built in the parent with the request;
- `write(document, folder, request)`: that document as the trainer's own job file(s) in `folder`,
  a private folder the probe deletes after, for the probe `request` (protocol.ProbeRequest): its
  `steps` training steps, saving and checkpoints off (or only the trainer's unavoidable final
  save), every output and cache inside `folder`, previews where the point has them, at the first
  step and at the last only (so the two sample phases are measured and nothing samples in
  between) and of at most its `sample.steps` denoising steps, the dataset and the model as the
  job gives them. It returns the file the command's `{job}` names;
- `scripts`: its entry points' file names, so a command that names another trainer's script is
  refused before any probe;
- `log_follower()`: its log-line phase rules, a callable taking each line the trainer prints (a
  tqdm redraw after `\r` included) and returning a `LogMark`: the probe phase (protocol.Phase) the
  run is in after it, or None before any line marks one, and the training steps its progress bar
  says are done. The meter inside the trainer's process (probe/trainer_meter.py) marks its phases
  and times its steps with it (the parent reads the log's OOMs and errors with oom.scan_log).

The registry `DIALECTS` is keyed by `key`, the name a probe request carries (`trainer_run.dialect`).
kohya sd-scripts and musubi-tuner plug in as two more entries. Nothing here imports torch: the
meter inside the trainer imports this module for the phase rules.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from fitfinder import oom

UNMARKED = "start"  # the meter's name for the run before its log marks a phase (the whole run if none does)


@dataclass(frozen=True)
class LogMark:
    """Where a trainer's log says the run is after a line."""

    phase: Optional[str]  # a probe phase, None before any line marks one
    steps_done: Optional[int]  # training steps done by its progress bar, None before a bar


class TrainerDialect(Protocol):
    key: str  # the request's trainer_run.dialect
    name: str  # in messages
    scripts: tuple[str, ...]  # the file names of its entry points

    def document(self, job) -> dict[str, Any]: ...

    def write(self, document: dict[str, Any], folder: Path, request: dict[str, Any]) -> Path: ...

    def log_follower(self) -> Callable[[str], LogMark]: ...


def probe_phase_follower() -> Callable[[str], LogMark]:
    """The phase rules every trainer's log shares (oom.log_follower: AI Toolkit's, kohya's and
    musubi-tuner's lines), named as a probe names its phases: a preview once training has
    started is the last sample; before any line marks a phase, None."""
    follow = oom.log_follower()

    def mark(line: str) -> LogMark:
        position = follow(line)
        phase: Optional[str] = position.phase
        if phase == "unknown":
            phase = None
        elif phase == "sample" and position.training_started:
            phase = "last_sample"
        return LogMark(phase, position.steps_done)

    return mark


# -- AI Toolkit ---------------------------------------------------------------------------------
class AiToolkit:
    """AI Toolkit's YAML job, run by its run.py (`python run.py JOB`), at commit 27a03a91."""

    key = "aitoolkit"
    name = "AI Toolkit"
    scripts = ("run.py",)

    def document(self, job) -> dict[str, Any]:
        """The job file without fitfinder's section, paths made absolute: the probe runs the
        trainer in its private folder, and AI Toolkit reads relative paths from its working
        directory (run.py puts os.getcwd() on sys.path; the datasets' folder_path is opened as is)."""
        data = json.loads(json.dumps(job.data, default=str))
        data.pop("fitfinder", None)
        for process in data["config"]["process"]:
            model = process.get("model") or {}
            if model.get("name_or_path") and Path(os.path.expanduser(str(model["name_or_path"]))).exists():
                model["name_or_path"] = str(Path(os.path.expanduser(str(model["name_or_path"]))).resolve())
            for dataset in process.get("datasets") or []:
                if dataset.get("folder_path"):
                    dataset["folder_path"] = str(Path(os.path.expanduser(str(dataset["folder_path"]))).resolve())
        return data

    def write(self, document: dict[str, Any], folder: Path, request: dict[str, Any]) -> Path:
        from fitfinder.jobconfig import JobFile  # ruamel: only where a job is written

        steps = int(request["steps"])
        data = json.loads(json.dumps(document))
        data["config"].pop("training_folder", None)  # the job-level default, in case a process reads it
        for index, process in enumerate(data["config"]["process"]):
            _probe_settings(process, folder, steps, int(request["sample"]["steps"]))
            for number, dataset in enumerate(process.get("datasets") or []):
                if dataset.get("folder_path"):
                    mirror = folder / "datasets" / f"{index}-{number}"
                    mirror_folder(Path(dataset["folder_path"]), mirror)
                    dataset["folder_path"] = str(mirror)
        path = folder / "job.yaml"
        path.write_text(JobFile(data, str(path)).dumps(["fitfinder trainer probe: the point, run for "
                                                        f"{steps} steps in this folder"]))
        return path

    def log_follower(self) -> Callable[[str], LogMark]:
        # Its lines (oom.LINE_PHASES): "Loading ..." and "Quantizing ..." for every part it loads
        # (toolkit/stable_diffusion_model.py load_model), "Caching text_embeddings for" and "Caching
        # latents for" (toolkit/dataloader_mixins.py), "Generating baseline samples before training"
        # (jobs/process/BaseSDTrainProcess.py run), its step bar named after the job, and the
        # preview's "Generating Images" bar (StableDiffusion.generate_images).
        return probe_phase_follower()


def _probe_settings(process: dict[str, Any], folder: Path, steps: int, sample_steps: int) -> None:
    """AI Toolkit's settings for a probe of `steps` steps, everything written inside `folder`."""
    # BaseTrainProcess.__init__: outputs go to training_folder/NAME (samples, the LoRA, its config,
    # the logger's files); log_dir, when set, is tensorboard's.
    process["training_folder"] = str(folder / "output")
    if process.get("log_dir"):
        process["log_dir"] = str(folder / "logs")
    train = process.setdefault("train", {})
    train["steps"] = steps
    # SaveConfig: save_every (default 1000) saves during training; BaseSDTrainProcess.run saves once
    # more at the end whatever it says (into the folder). No step save, no hub upload.
    save = process.setdefault("save", {})
    save.update(save_every=steps + 1, max_step_saves_to_keep=1, push_to_hub=False)
    logging = process.setdefault("logging", {})
    logging["use_wandb"] = False
    # Previews: the first one unless skip_first_sample or disable_sampling (kept as the point has
    # them), the last one at the end of training (BaseSDTrainProcess.run, after the loop), none in
    # between (sample_every past the steps). Each denoising step holds the same memory, and the
    # largest preview sets the peak: that one prompt, at the request's denoising steps (request.SAMPLE_STEPS).
    sample = process.setdefault("sample", {})
    sample["sample_every"] = steps + 1
    sample["sample_steps"] = sample_steps
    largest = _largest_preview(sample, sample_steps)
    if largest is not None:
        sample.pop("prompts", None)
        sample["samples"] = [largest]


def _largest_preview(sample: dict[str, Any], sample_steps: int) -> dict[str, Any] | None:
    """The preview with the most pixels as a `samples` item (SampleItem: width/height default to the
    sample config's), or None without prompts. Its own sample_steps are capped like the config's."""
    width, height = int(sample.get("width", 512)), int(sample.get("height", 512))
    items = [item if isinstance(item, dict) else {"prompt": str(item)}
             for item in (sample.get("samples") or sample.get("prompts") or [])]
    if not items:
        return None
    largest = dict(max(items, key=lambda item: int(item.get("width", width)) * int(item.get("height", height))))
    if "sample_steps" in largest:
        largest["sample_steps"] = min(sample_steps, int(largest["sample_steps"]))
    return largest


def mirror_folder(source: Path, mirror: Path) -> int:
    """A copy of `source` made of links to its files, in real folders: a trainer that writes its caches
    next to the images (AI Toolkit's _latent_cache and _t_e_cache, toolkit/dataloader_mixins.py) writes
    them in `mirror`, and the user's folder is left as it was. Returns the number of files linked."""
    count = 0
    if not source.is_dir():
        return count
    for root, folders, files in os.walk(source):
        here = mirror / Path(root).relative_to(source)
        here.mkdir(parents=True, exist_ok=True)
        folders[:] = [name for name in folders if name not in ("_latent_cache", "_t_e_cache")]
        for name in files:
            os.symlink(Path(root) / name, here / name)
            count += 1
    return count


DIALECTS: dict[str, TrainerDialect] = {dialect.key: dialect for dialect in (AiToolkit(),)}

# Trainers whose jobs fitfinder does not write yet, by their entry scripts' file names (the top level
# of kohya-ss/sd-scripts at 48d368fa and kohya-ss/musubi-tuner at 30c658c, which also runs them as
# `python -m musubi_tuner.NAME`): a command naming one would get a job file it cannot read. A trainer
# that gets a dialect leaves this table (the dialect's `scripts` say the same).
UNWRITTEN_TRAINERS: dict[str, tuple[str, ...]] = {
    "kohya sd-scripts": (
        "train_network.py", "sdxl_train_network.py", "flux_train_network.py", "sd3_train_network.py",
        "lumina_train_network.py", "anima_train_network.py", "hunyuan_image_train_network.py", "train_db.py",
        "fine_tune.py", "sdxl_train.py", "flux_train.py", "sd3_train.py", "lumina_train.py", "anima_train.py",
        "train_textual_inversion.py", "train_textual_inversion_XTI.py", "sdxl_train_textual_inversion.py",
        "train_control_net.py", "train_controlnet.py", "flux_train_control_net.py", "sdxl_train_control_net.py",
        "sdxl_train_control_net_lllite.py", "sdxl_train_control_net_lllite_old.py"),
    "musubi-tuner": (
        "wan_train_network.py", "qwen_image_train_network.py", "qwen_image_train.py", "flux_kontext_train_network.py",
        "flux_2_train_network.py", "zimage_train_network.py", "zimage_train.py", "hv_train_network.py",
        "hv_train.py", "hv_1_5_train_network.py", "fpack_train_network.py", "hidream_o1_train_network.py",
        "hidream_o1_train.py", "ideogram4_train_network.py", "kandinsky5_train_network.py",
        "krea2_train_network.py"),
}


def trainer_of_script(name: str) -> str | None:
    """The trainer whose entry script a file name (or `-m` module's last part, with .py) is, or None."""
    for dialect in DIALECTS.values():
        if name in dialect.scripts:
            return dialect.key
    return next((trainer for trainer, scripts in UNWRITTEN_TRAINERS.items() if name in scripts), None)


def dialect_of(job) -> TrainerDialect:
    """The dialect of a job's file: AI Toolkit's YAML, the one format read today (the trainers'
    package, issue 30, names the others)."""
    return DIALECTS["aitoolkit"]
