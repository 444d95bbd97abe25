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

The registry `DIALECTS` is keyed by `key`, the name a probe request carries (`trainer_run.dialect`):
AI Toolkit's YAML job (`AiToolkit`), and kohya sd-scripts' and musubi-tuner's training scripts run
with one `--config_file` TOML (`Kohya`, two instances). Nothing here imports torch, nor what only
the parent has (ruamel, tomli_w, the trainers' package): the meter inside the trainer imports this
module for the phase rules, in the trainer's own environment.
"""

from __future__ import annotations

import json
import os
import re
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
    return _follower(lambda position: position.training_started)


def _follower(is_last: Callable[[Any], bool]) -> Callable[[str], LogMark]:
    """oom.log_follower's positions as probe phases; a preview is the last sample where `is_last`
    says so of the log's position (a trainer's own rule for which preview it is)."""
    follow = oom.log_follower()

    def mark(line: str) -> LogMark:
        position = follow(line)
        phase: Optional[str] = position.phase
        if phase == "unknown":
            phase = None
        elif phase == "sample" and is_last(position):
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
        from fitfinder.trainers.aitoolkit_job import JobFile  # ruamel: only where a job is written

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


def mirror_folder(source: Path, mirror: Path, caches: Callable[[str], bool] | None = None) -> int:
    """A copy of `source` made of links to its files, in real folders: a trainer that writes its caches
    next to the images (AI Toolkit's _latent_cache and _t_e_cache, toolkit/dataloader_mixins.py) writes
    them in `mirror`, and the user's folder is left as it was. Its existing caches are left out (the
    caching pass is measured): AI Toolkit's folders, and the files `caches` names (kohya's .npz).
    Returns the number of files linked."""
    count = 0
    if not source.is_dir():
        return count
    for root, folders, files in os.walk(source):
        here = mirror / Path(root).relative_to(source)
        here.mkdir(parents=True, exist_ok=True)
        folders[:] = [name for name in folders if name not in ("_latent_cache", "_t_e_cache")]
        for name in files:
            if caches is not None and caches(name):
                continue
            os.symlink(Path(root) / name, here / name)
            count += 1
    return count


# -- kohya sd-scripts and musubi-tuner ----------------------------------------------------------
# Options a probe's job leaves out, each with why (sd-scripts library/train_util.py and musubi-tuner
# src/musubi_tuner/training/parser_common.py declare them; their use is in train_network.py
# NetworkTrainer.train and training/trainer_base.py NetworkTrainer.train, which read them alike).
_NOT_IN_A_PROBE = (
    # NetworkTrainer.train: "override steps. steps for N epochs": epochs would override max_train_steps.
    "max_train_epochs",
    # No step or epoch save, no state: train() saves the LoRA once at its end whatever these say
    # (save_model(ckpt_name, ...) after the loop), into output_dir, inside the folder. save_n_epoch_ratio
    # sets save_every_n_epochs (train_network.py).
    "save_every_n_epochs", "save_every_n_steps", "save_n_epoch_ratio", "save_last_n_epochs",
    "save_last_n_epochs_state", "save_last_n_steps", "save_last_n_steps_state", "save_state",
    "save_state_on_train_end", "save_state_to_huggingface",
    # A saved state would bring back its step count and optimizer (resume_from_local_or_hf_if_specified).
    "resume", "resume_from_huggingface",
    # No upload, no tracker outside the folder (logging_dir, when set, moves into it).
    "async_upload", "log_with", "log_tracker_name", "log_tracker_config", "wandb_api_key", "wandb_run_name",
    # Previews at the first step and the last only (sample_every_n_steps = the steps): sample_every_n_epochs
    # wins over sample_every_n_steps (train_util.sample_images_common, sampling_prompts.should_sample_images).
    "sample_every_n_epochs",
    # read_config_from_file: output_config writes the arguments as a TOML and exits; config_file is this file.
    "output_config", "config_file",
    # sd-scripts' library/utils.py setup_logging: a log file takes the lines the probe reads its phases
    # from, a level above INFO drops them.
    "console_log_file", "console_log_level",
)
# A relative value of these keys, or with these suffixes, is a path whether it is there or not (a model
# file that is not there is looked for, and missed, where fitfinder looked).
_PATH_KEYS = ("_dir", "_directory", "_file", "_path")
_PATH_SUFFIXES = (".safetensors", ".sft", ".pth", ".pt", ".ckpt", ".bin", ".gguf", ".toml", ".txt", ".json", ".jsonl")
_STEPS_OPTION = re.compile(r"(\s--s\s+)(\d+)")  # a prompt line's denoising steps (train_util.line_to_prompt_dict)


class Kohya:
    """A kohya training script (sd-scripts' or musubi-tuner's), its job written as one `--config_file`
    TOML and its dataset TOML.

    `{job}` names that TOML: `python flux_train_network.py --config_file {job}`. Every option the job
    sets goes into it, the shell file's command line and its own config TOML merged, because both
    trainers read a config file into the namespace the command line is then parsed over
    (read_config_from_file in sd-scripts' library/train_util.py and musubi-tuner's
    training/parser_common.py): one file says the whole job, and the command the user gives stays
    the same for every point. Options on the command line after it still win, as they would.
    """

    def __init__(self, key: str, name: str, scripts: tuple[str, ...], caches_beside_images: bool,
                 probe_options: dict[str, Any] | None = None):
        self.key, self.name, self.scripts = key, name, scripts
        self.caches_beside_images = caches_beside_images
        self.probe_options = dict(probe_options or {})  # this trainer's own settings for any probe

    def document(self, job) -> dict[str, Any]:
        """The options the job sets, its dataset TOML (with fitfinder's changes) and its largest preview
        prompt line; relative paths made absolute, read from the job file's folder as fitfinder reads
        them (the trainer runs in the probe's folder)."""
        from fitfinder.trainers import _kohya  # the parent's side: the job is read there

        def absolute(key: str, value: Any) -> Any:
            if isinstance(value, dict):
                return {name: absolute(name, item) for name, item in value.items()}
            if isinstance(value, list):
                return [absolute(key, item) for item in value]
            path = _kohya.resolve(job, value) if isinstance(value, str) else None
            if path is not None and (path.exists() or key.endswith(_PATH_KEYS)
                                     or Path(value).suffix.lower() in _PATH_SUFFIXES):  # not ".txt" alone
                return str(path.resolve())
            return value

        return {"script": job.script.name, "options": absolute("", job.options_set()),
                "dataset": absolute("", job.dataset_data()), "preview": _kohya.largest_prompt_line(job)}

    def write(self, document: dict[str, Any], folder: Path, request: dict[str, Any]) -> Path:
        import tomli_w  # the parent's side (fitfinder's environment): the trainer's needs only torch

        steps = int(request["steps"])
        options = {key: value for key, value in document["options"].items()
                   if key not in _NOT_IN_A_PROBE and not key.startswith("huggingface_")}
        options.update(max_train_steps=steps, output_dir=str(folder / "output"),
                       dataset_config=str(folder / "job_dataset.toml"), **self.probe_options)
        if "logging_dir" in options:
            options["logging_dir"] = str(folder / "logs")
        _kohya_previews(options, document.get("preview"), folder, request)
        dataset = self._dataset(document["dataset"], folder)
        (folder / "job_dataset.toml").write_text(tomli_w.dumps(dataset))
        path = folder / "job.toml"
        path.write_text(f"# fitfinder trainer probe: the point for {document['script']}, run for {steps} steps in "
                        f"this folder\n" + tomli_w.dumps(options))
        return path

    def _dataset(self, dataset: dict[str, Any], folder: Path) -> dict[str, Any]:
        """The dataset TOML for the probe. sd-scripts writes its caches next to each image (every
        caching strategy's get_latents_npz_path and get_outputs_npz_path, library/strategy_*.py:
        the image's path without its suffix, plus `_WxH_flux.npz`, `_flux_te.npz`, ...): each
        subset's image_dir becomes a mirror of links inside the folder, its .npz caches left out, so
        the caching pass is measured and the user's folder is not written. musubi-tuner's training
        only reads the caches its caching scripts wrote (dataset/image_video_dataset.py: it globs
        `*_{architecture}.safetensors` in cache_directory, image_directory when unset): the dataset
        stays as given, its paths absolute."""
        data = json.loads(json.dumps(dataset))
        if not self.caches_beside_images:
            return data
        for index, entry in enumerate(data.get("datasets") or []):
            for number, subset in enumerate(entry.get("subsets") or []):
                if isinstance(subset, dict) and subset.get("image_dir"):
                    mirror = folder / "datasets" / f"{index}-{number}"
                    mirror_folder(Path(subset["image_dir"]), mirror, caches=lambda name: name.endswith(".npz"))
                    subset["image_dir"] = str(mirror)
        return data

    def log_follower(self) -> Callable[[str], LogMark]:
        return kohya_phase_follower()


def _kohya_previews(options: dict[str, Any], preview: str | None, folder: Path, request: dict[str, Any]) -> None:
    """Previews where the point has them, at the first step and after the last only, of the largest
    prompt at no more than the request's denoising steps. sample_at_first samples at step 0; with
    sample_every_n_steps = the steps and no sample_every_n_epochs, the loop samples after the last
    step and no epoch's end does (train_util.sample_images_common, musubi-tuner's
    sampling_prompts.should_sample_images)."""
    sample, steps = request["sample"], int(request["steps"])
    if not (sample.get("first") or sample.get("last")):
        for key in ("sample_prompts", "sample_at_first", "sample_every_n_steps"):
            options.pop(key, None)
        return
    options["sample_at_first"] = bool(sample.get("first"))
    if sample.get("last"):
        options["sample_every_n_steps"] = steps
    else:
        options.pop("sample_every_n_steps", None)
    if preview is None:  # a .toml or .json prompt file, not read: as the job gives it
        return
    most = int(sample["steps"])
    if _STEPS_OPTION.search(" " + preview):
        line = _STEPS_OPTION.sub(lambda m: f"{m.group(1)}{min(most, int(m.group(2)))}", " " + preview).strip()
    else:  # without --s a preview takes the script's default steps (20 to 36), more than a probe's
        line = f"{preview.rstrip()} --s {most}"
    path = folder / "job_prompts.txt"
    path.write_text(line + "\n")
    options["sample_prompts"] = str(path)


def kohya_phase_follower() -> Callable[[str], LogMark]:
    """kohya's log by the shared rules (oom.log_follower reads sd-scripts' and musubi-tuner's lines:
    `Building ...` and `Loading state dict from` / `Loading DiT model from` (load), `caching latents`
    (latents), `move text encoders to gpu`, `caching Text Encoder outputs`, `cache Text Encoder outputs
    for sample prompt` (text_encoder), `running training / 学習開始`, the `steps` bar (train), and
    `generating sample images at step / サンプル画像生成 ステップ: N` (sample)), with one difference
    from AI Toolkit's: both trainers print "running training" before the sample_at_first preview
    (NetworkTrainer.train: the print, then sample_images at step 0, then the loop), so a preview is
    the first one until a step is done, the last one after."""
    return _follower(lambda position: (position.steps_done or 0) > 0)


# The entry scripts' file names: the top level of kohya-ss/sd-scripts at 48d368fa and
# src/musubi_tuner/ of kohya-ss/musubi-tuner at 30c658c4 (which also runs them as `python -m
# musubi_tuner.NAME`). A command naming one for another trainer's job is refused (trainer_command).
SD_SCRIPTS = Kohya("sd-scripts", "kohya sd-scripts", (
    "train_network.py", "sdxl_train_network.py", "flux_train_network.py", "sd3_train_network.py",
    "lumina_train_network.py", "anima_train_network.py", "hunyuan_image_train_network.py", "train_db.py",
    "fine_tune.py", "sdxl_train.py", "flux_train.py", "sd3_train.py", "lumina_train.py", "anima_train.py",
    "train_textual_inversion.py", "train_textual_inversion_XTI.py", "sdxl_train_textual_inversion.py",
    "train_control_net.py", "train_controlnet.py", "flux_train_control_net.py", "sdxl_train_control_net.py",
    "sdxl_train_control_net_lllite.py", "sdxl_train_control_net_lllite_old.py"), caches_beside_images=True,
    # library/utils.py setup_logging: rich's handler draws each line to the console's width (80 columns
    # when piped), wrapping a long one; console_log_simple logs each message as one plain line on stdout.
    probe_options={"console_log_simple": True})
MUSUBI_TUNER = Kohya("musubi-tuner", "musubi-tuner", (
    "wan_train_network.py", "qwen_image_train_network.py", "qwen_image_train.py", "flux_kontext_train_network.py",
    "flux_2_train_network.py", "flux_2_train_network_self_flow.py", "zimage_train_network.py", "zimage_train.py",
    "hv_train_network.py", "hv_train.py", "hv_1_5_train_network.py", "fpack_train_network.py",
    "hidream_o1_train_network.py", "hidream_o1_train.py", "ideogram4_train_network.py",
    "kandinsky5_train_network.py", "krea2_train_network.py"), caches_beside_images=False)

DIALECTS: dict[str, TrainerDialect] = {dialect.key: dialect for dialect in (AiToolkit(), SD_SCRIPTS, MUSUBI_TUNER)}


def trainer_of_script(name: str) -> str | None:
    """The trainer whose entry script a file name (or `-m` module's last part, with .py) is, or None."""
    return next((dialect.key for dialect in DIALECTS.values() if name in dialect.scripts), None)


def dialect_of(job) -> TrainerDialect:
    """The dialect of a job's file: a kohya job's trainer's (trainers.KohyaJob: its `trainer` module
    names its repository), else AI Toolkit's YAML."""
    repo = getattr(getattr(job, "trainer", None), "REPO", None)
    return DIALECTS[repo] if repo in DIALECTS else DIALECTS["aitoolkit"]
