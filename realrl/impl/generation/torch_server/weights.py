"""Reading new weights from disk and putting them into the served model.

`read_weights_dir` reads the safetensors of an HF directory (single file or
sharded with an index) into CPU tensors (`read_weights_converted` through
transformers' loading, for a checkpoint whose layout differs from the model's
in memory, e.g. MoE experts fused on load); `WeightTargets.check` compares their
names and shapes with the model's (tied embeddings: either name of an aliased
pair will do), and `WeightTargets.copy_in` copies them into the existing
parameters in place. LoRA adapters (docs/design.md §8): `read_adapter` reads a
peft adapter directory, `AdapterTargets.check` compares it with the model and
`AdapterTargets.apply` merges it into the adapted weights (from a copy of
their base values). Reading and checking touch no model state, so they run
on a helper thread while the engine goes on generating; a bad path or a
mismatch raises `WeightLoadError` and the old weights keep serving.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch

from realrl.base import faults


class WeightLoadError(RuntimeError):
    """The weights at a path cannot be loaded into this model."""


def read_weights_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors directory (single file or sharded + index), on CPU."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise WeightLoadError(f"{path!r} is not a directory")
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise WeightLoadError(f"cannot read {index}: {e}") from e
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no safetensors files in {path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file, device="cpu"))
        except Exception as e:  # missing shard, truncated file, bad header
            raise WeightLoadError(f"cannot read {file}: {e}") from e
    return tensors


def read_weights_converted(path: str, model_class: type) -> dict[str, torch.Tensor]:
    """The tensors of an HF directory as `model_class.from_pretrained` lays
    them out in memory (its checkpoint conversions applied, e.g. MoE experts
    fused), on CPU in the file's dtype."""
    try:
        model = model_class.from_pretrained(path, dtype="auto", device_map="cpu")
    except Exception as e:
        raise WeightLoadError(f"cannot load {path!r} with {model_class.__name__}: {e}") from e
    return {name: t.detach() for name, t in model.state_dict().items()}


class WeightTargets:
    """The model's state-dict tensors (sharing storage with its parameters) and
    which names are aliases of one another (tied embeddings)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.tensors = dict(model.state_dict())
        groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
        for name, t in self.tensors.items():
            groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(name)
        self.groups = list(groups.values())

    def needs_conversion(self, loaded: dict[str, torch.Tensor]) -> bool:
        """Whether the file names tensors the model does not have (another layout)."""
        return any(k not in self.tensors and not k.endswith("rotary_emb.inv_freq") for k in loaded)

    def check(self, loaded: dict[str, torch.Tensor], complete: bool = True) -> None:
        """Names and shapes against the model; `complete`: every tensor is there
        (else a part of them: one bucket of a distributed update)."""
        loaded = {k: v for k, v in loaded.items() if not k.endswith("rotary_emb.inv_freq")}
        unexpected = sorted(set(loaded) - set(self.tensors))
        if unexpected:
            raise WeightLoadError(f"unexpected tensors {unexpected[:5]} (model has no such parameters)")
        for name, t in loaded.items():
            if tuple(t.shape) != tuple(self.tensors[name].shape):
                raise WeightLoadError(
                    f"shape of {name}: file {tuple(t.shape)} vs model {tuple(self.tensors[name].shape)}"
                )
        missing = [group[0] for group in self.groups if not any(name in loaded for name in group)]
        if missing and complete:
            raise WeightLoadError(f"missing tensors {missing[:5]}")

    @torch.no_grad()
    def copy_in(self, loaded: dict[str, torch.Tensor]) -> None:
        for name, t in loaded.items():
            if name in self.tensors:
                self.tensors[name].copy_(t)

    def swappable(self, loaded: dict[str, torch.Tensor]) -> bool:
        """Whether `loaded` (checked: every tensor there) can become the
        model's own as they are (`swap_in`): on the CPU, each in its target's
        dtype, one per alias group."""
        for group in self.groups:
            names = [name for name in group if name in loaded]
            if len(names) != 1:
                return False
            t, target = loaded[names[0]], self.tensors[names[0]]
            if t.device.type != "cpu" or target.device.type != "cpu" or t.dtype != target.dtype:
                return False
        return True

    @torch.no_grad()
    def swap_in(self, loaded: dict[str, torch.Tensor]) -> None:
        """The model's parameters and buffers take `loaded`'s storage (no
        copy: `swappable` said so); every alias of a tied tensor takes it."""
        for group in self.groups:
            t = next(loaded[name] for name in group if name in loaded)
            for name in group:
                path, _, attr = name.rpartition(".")
                module = self.model.get_submodule(path)
                owner = module._parameters.get(attr)
                (owner if owner is not None else module._buffers[attr]).data = t
        self.tensors = dict(self.model.state_dict())  # (views of the new storage)


# ---- LoRA adapters ---------------------------------------------------------------------------

_PREFIX = "base_model.model."  # peft's key prefix in adapter_model.safetensors


@dataclasses.dataclass
class LoraAdapter:
    """A peft LoRA adapter: for each adapted module, its A (r x in) and B
    (out x r); its delta weight is `scaling * B @ A`."""

    path: str
    rank: int
    scaling: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path -> (A, B)
    fan_in_fan_out: bool = False  # the base stores W transposed (GPT-2's Conv1D): the delta is too


def read_adapter(path: str) -> LoraAdapter:
    """A peft adapter directory (`adapter_config.json` + `adapter_model.safetensors`),
    plain LoRA only: WeightLoadError for anything else (DoRA, extra trained
    modules or biases, per-module ranks) or a broken file."""
    from safetensors.torch import load_file

    config_path, weights_path = (
        os.path.join(path, "adapter_config.json"),
        os.path.join(path, "adapter_model.safetensors"),
    )
    if not os.path.isfile(config_path) or not os.path.isfile(weights_path):
        raise WeightLoadError(
            f"{path!r} is not a LoRA adapter directory (adapter_config.json + adapter_model.safetensors)"
        )
    try:
        with open(config_path) as f:
            config = json.load(f)
        tensors = load_file(weights_path, device="cpu")
    except Exception as e:  # unreadable JSON, truncated file, bad header
        raise WeightLoadError(f"cannot read the adapter in {path!r}: {e}") from e
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise WeightLoadError(f"{config_path}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    unsupported = [
        key
        for key, plain in (
            ("use_dora", False),
            ("bias", "none"),
            ("lora_bias", False),
            ("modules_to_save", None),
            ("rank_pattern", {}),
            ("alpha_pattern", {}),
            ("layer_replication", None),
        )
        if config.get(key, plain) not in (plain, None, [], {})
    ]
    if unsupported:
        raise WeightLoadError(f"{config_path}: only plain LoRA is supported; this adapter sets {unsupported}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise WeightLoadError(f"{config_path}: r must be a positive integer and lora_alpha positive")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if key.startswith(_PREFIX) and key.endswith(suffix):
                modules.setdefault(key[len(_PREFIX) : -len(suffix)], {})[part] = t
                break
        else:
            raise WeightLoadError(f"{weights_path}: unexpected tensor {key!r} (only lora_A / lora_B weights)")
    pairs = {}
    for name, parts in sorted(modules.items()):
        a, b = parts.get("lora_A"), parts.get("lora_B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise WeightLoadError(f"{weights_path}: {name} needs lora_A (r x in) and lora_B (out x r) with r = {rank}")
        pairs[name] = (a, b)
    if not pairs:
        raise WeightLoadError(f"{weights_path}: no adapted module")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraAdapter(path, rank, float(scaling), pairs, bool(config.get("fan_in_fan_out")))


class AdapterTargets:
    """Applies LoRA adapters to a model's resident weights by merging: each
    adapted weight becomes `W0 + scaling * B @ A` (in float32, then cast),
    with W0 a copy of the base weight taken the first time the module is
    adapted. Applying a new adapter recomputes from W0, so versions never
    accumulate rounding, and a module the new adapter leaves out gets W0 back.
    W0 is kept on the CPU: a copy beside the weights on an accelerator would
    double the adapted weights' memory (one module at a time goes over).

    An apply is all or nothing: when merging fails part-way (out of memory,
    say), the modules already changed get the adapter merged before back
    (from W0 again), so the model is exactly what it was, and the error is
    raised for the caller to report (docs/design.md §8)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._base: dict[str, torch.Tensor] = {}  # module path -> W0, on the CPU
        self.applied: LoraAdapter | None = None  # the adapter merged into the weights now

    def _weight(self, module_path: str) -> torch.Tensor:
        try:
            module = self.model.get_submodule(module_path)
        except AttributeError:
            raise WeightLoadError(f"the adapter adapts {module_path!r}, which this model does not have") from None
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise WeightLoadError(f"the adapter adapts {module_path!r}, which has no 2-D weight")
        return weight

    def check(self, adapter: LoraAdapter) -> None:
        """Names and shapes against the model (any thread; nothing is changed)."""
        aliases: dict[int, int] = {}  # storage -> names (looked up now: a version swapped in moves them)
        for t in self.model.state_dict().values():
            aliases[t.data_ptr()] = aliases.get(t.data_ptr(), 0) + 1
        for name, (a, b) in adapter.modules.items():
            weight = self._weight(name)
            out_features, in_features = weight.shape[::-1] if adapter.fan_in_fan_out else weight.shape
            if (b.shape[0], a.shape[1]) != (out_features, in_features):
                raise WeightLoadError(
                    f"{name}: adapter is {b.shape[0]} x {a.shape[1]}, the layer {out_features} x {in_features}"
                )
            if aliases.get(weight.data_ptr(), 0) > 1:
                raise WeightLoadError(
                    f"{name}: its weight is tied to another tensor; a merged adapter would change both"
                )

    @torch.no_grad()
    def apply(self, adapter: LoraAdapter | None) -> None:
        """Serve `adapter` merged into the weights (None: the base weights);
        on failure the weights are left as they were and the error raised."""
        modules = adapter.modules if adapter is not None else {}
        for name in modules:  # before any weight changes: a failure here changes nothing
            if name not in self._base:
                self._base[name] = self._weight(name).detach().to("cpu", copy=True)
        changed: list[str] = []
        try:
            for name in self._base:
                changed.append(name)
                self._merge(name, adapter)
                if faults.point("torch_server.adapter_merge"):
                    raise RuntimeError("fault point torch_server.adapter_merge: merging failed part-way")
        except BaseException:
            for name in changed:  # what it was: the adapter merged before (what worked then works now)
                self._merge(name, self.applied)
            raise
        self.applied = adapter
        faults.point("torch_server.adapter_applied")

    def _merge(self, name: str, adapter: LoraAdapter | None) -> None:
        """One module's weight := W0 (+ the adapter's s B A, if it adapts it)."""
        weight = self._weight(name)
        base = self._base[name].to(weight.device)
        if adapter is None or name not in adapter.modules:
            weight.copy_(base)
            return
        a, b = (t.to(weight.device, torch.float32) for t in adapter.modules[name])
        if adapter.fan_in_fan_out:  # W is stored transposed: W^T + s (B A)^T = W^T + s A^T B^T
            a, b = b.T, a.T
        if weight.dtype == torch.float32:  # one fused pass: weight = W0 + s B A
            torch.addmm(base, b, a, alpha=adapter.scaling, out=weight)
        else:
            weight.copy_(torch.addmm(base.float(), b, a, alpha=adapter.scaling))


class AdapterSlots:
    """The LoRA adapters a server holds, by name (SGLang's LoRA API):
    `/load_lora_adapter` adds one, `/update_weight_version` then switches to
    the one loaded last if it is not the one serving. Shared by the torch
    server's engine and the simulated one, so both keep the same rules."""

    def __init__(self) -> None:
        self.adapters: dict[str, LoraAdapter] = {}
        self.loaded_last: str | None = None  # served from the next update_weight_version on
        self.serving: str | None = None

    def load(self, name: str, adapter: LoraAdapter) -> str | None:
        """None, or why not (a name already loaded)."""
        if name in self.adapters:
            return f"LoRA adapter {name!r} is already loaded"
        self.adapters[name] = adapter
        self.loaded_last = name
        return None

    def unload(self, name: str) -> str | None:
        """None, or why not (a name not loaded)."""
        if self.adapters.pop(name, None) is None:
            return f"LoRA adapter {name!r} is not loaded"
        if self.loaded_last == name:
            self.loaded_last = None
        return None

    def to_switch_to(self) -> tuple[str, LoraAdapter] | None:
        """(name, adapter) an update_weight_version switches to, or None."""
        last = self.loaded_last
        return (last, self.adapters[last]) if last is not None and last != self.serving else None

    def paths(self) -> dict[str, str]:
        return {name: adapter.path for name, adapter in self.adapters.items()}
