"""Test model (python backend, decoupled): a stand-in for a NAME_llm serving LoRA adapters, for the gateway's tests.

Control requests (`text_input` "" and the parameter `adapter_admin`, JSON: list / load NAME PATH / unload NAME)
answer the adapters held after the action as NAME_llm does; a path must resolve inside the model repository or a
folder of the config parameter `adapter_roots` (comma-separated), and
hold adapter_config.json (its `r`, `lora_alpha`, `target_modules`) and adapter_model.safetensors (any bytes: their
sha256 with the config's is the adapter's). A generation answers "[ADAPTER SHA8 #N]" and " ok" (two events when
`stream` is true), N counting the generations this model made (a cached answer repeats its N); an adapter that is not
loaded is NAME_llm's error."""

import hashlib
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(sender, message: str) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)),
                flags=FINAL)


def _text(value: str, tokens: int = 1):
    return pb_utils.InferenceResponse([
        pb_utils.Tensor("text_output", np.array([value.encode()], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.arange(tokens, dtype=np.int64)),
        pb_utils.Tensor("prompt_tokens", np.array([3], dtype=np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.repository = Path(args["model_repository"]).resolve().parent
        config = json.loads(args["model_config"])
        roots = config.get("parameters", {}).get("adapter_roots", {}).get("string_value", "")
        self.roots = [self.repository, *(Path(r).resolve() for r in roots.split(",") if r)]
        self.adapters: dict[str, dict] = {}
        self.made = 0

    def _load(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise ValueError(f"adapter '{name}' is already loaded (unload it first)")
        folder = (self.repository / path).resolve()
        if not any(folder.is_relative_to(root) for root in self.roots):
            raise ValueError(f"adapter path {path} is outside the model repository and the allowed roots")
        files = [folder / "adapter_config.json", folder / "adapter_model.safetensors"]
        if not all(f.is_file() for f in files):
            raise ValueError(f"{path} is not a PEFT LoRA adapter folder (adapter_config.json, "
                             "adapter_model.safetensors)")
        config = json.loads(files[0].read_text())
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.read_bytes())
        self.adapters[name] = {"name": name, "sha256": digest.hexdigest(), "rank": int(config["r"]),
                               "alpha": float(config["lora_alpha"]), "targets": sorted(config["target_modules"]),
                               "path": path}

    def _admin(self, action: dict) -> None:
        if action.get("action") == "load":
            self._load(str(action["name"]), str(action["path"]))
        elif action.get("action") == "unload":
            if self.adapters.pop(str(action["name"]), None) is None:
                raise ValueError(f"adapter '{action['name']}' is not loaded: nothing to unload")
        elif action.get("action") != "list":
            raise ValueError(f"unknown adapter_admin action {action.get('action')!r}")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            parameters = json.loads(request.parameters() or "{}")
            if "adapter_admin" in parameters:
                try:
                    self._admin(json.loads(parameters["adapter_admin"]))
                except (ValueError, KeyError) as e:
                    _error(sender, str(e))
                    continue
                sender.send(_text(json.dumps({"adapters": list(self.adapters.values())})), flags=FINAL)
                continue
            name = parameters.get("adapter", "")
            if name and name not in self.adapters:
                _error(sender, f"adapter '{name}' is not loaded: the loaded ones are "
                               f"{', '.join(self.adapters) or 'none'}")
                continue
            self.made += 1
            sha = self.adapters[name]["sha256"][:8] if name else "-"
            stream = pb_utils.get_input_tensor_by_name(request, "stream")
            head = f"[{name or 'base'} {sha} #{self.made}]"
            if stream is not None and bool(stream.as_numpy().reshape(-1)[0]):
                sender.send(_text(head))
                sender.send(_text(" ok"))
                sender.send(flags=FINAL)
            else:  # Triton's `generate`: one response
                sender.send(_text(head + " ok", 2), flags=FINAL)
        return None
