"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors, which peft's
PeftModel.from_pretrained loads over the base model.
"""

import json
from pathlib import Path

import numpy as np

from shard.run.hf import save_safetensors

# shard's targets -> the Llama module PEFT adapts (its `target_modules` names and key paths)
PEFT_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def adapters_to_peft(adapters: dict, lora) -> dict[str, np.ndarray]:
    """PEFT's tensors of shard's adapters: per layer and target, lora_A (rank, in features) and lora_B
    (out features, rank), the features flattened as the HF weight's are (heads outer, head_dim inner)."""
    layers = adapters["layers"]
    out = {}
    for target in lora.targets:
        a_lir, b_lro = np.asarray(layers[f"{target}_lora_a"]), np.asarray(layers[f"{target}_lora_b"])
        for i in range(a_lir.shape[0]):
            prefix = f"base_model.model.model.layers.{i}.{PEFT_MODULES[target]}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a_lir[i].reshape(-1, lora.rank).T, np.float32)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b_lro[i].reshape(lora.rank, -1).T, np.float32)
    return out


def peft_config(lora, base: str = "") -> dict:
    """adapter_config.json of shard's LoRA settings: PEFT's scale is lora_alpha / r, as shard's."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": sorted(PEFT_MODULES[t].split(".")[1] for t in lora.targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
            "base_model_name_or_path": base or None}


def write_peft_dir(path: str | Path, adapters: dict, lora, base: str = "") -> list[Path]:
    """adapter_config.json + adapter_model.safetensors that peft's PeftModel.from_pretrained loads over
    the base model (`base`: where it is, written into the config)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps(peft_config(lora, base), indent=1))
    save_safetensors(adapters_to_peft(adapters, lora), root / "adapter_model.safetensors")
    return [root / "adapter_config.json", root / "adapter_model.safetensors"]
