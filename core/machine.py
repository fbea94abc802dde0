"""What this machine is: CPU model and the instruction-set flags that matter for inference kernels, and whether
timings taken on one machine describe another. A CPU's family, model and stepping (`cpu_id`) tell apart processors
that a virtual machine names alike ("AMD EPYC") with the same flags."""

from __future__ import annotations

import os
import platform

INTERESTING_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


def cpu_info() -> dict:
    model, flags, fields = platform.processor() or platform.machine(), set(), {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    model = value
                elif key == "flags":
                    flags = set(value.split())
                elif key in ("cpu family", "model", "stepping"):
                    fields.setdefault(key, value)
                elif not key and fields:  # the first processor's block ends
                    break
    except OSError:
        pass
    info = {"cpu": model, "cpu_flags": [f for f in INTERESTING_CPU_FLAGS if f in flags],
            "logical_cores": os.cpu_count()}
    if len(fields) == 3:
        info["cpu_id"] = f"family {fields['cpu family']} model {fields['model']} stepping {fields['stepping']}"
    return info


def machine_identity(hardware: dict) -> dict:
    """The part of a profile's `hardware` that timings depend on: the GPU, or the CPU, its flags and threads."""
    if hardware.get("device") == "cuda" or "gpu" in hardware:
        setup = {key: hardware[key] for key in ("gpus", "offload", "resident") if hardware.get(key) not in (None, 1)}
        link = (hardware.get("host_link") or {}).get("name") if setup else None
        return {"device": "cuda", "gpu": hardware.get("gpu"), **setup, **({"host_link": link} if link else {})}
    return {"device": "cpu", "cpu": hardware.get("cpu"), "cpu_flags": list(hardware.get("cpu_flags") or []),
            "threads": hardware.get("threads"), **({"cpu_id": hardware["cpu_id"]} if hardware.get("cpu_id") else {})}


def this_machine(device: str) -> dict:
    import torch

    if device.startswith("cuda"):
        return {"device": "cuda", "gpu": torch.cuda.get_device_name(torch.device(device))}
    info = cpu_info()
    return machine_identity({**info, "device": "cpu", "threads": torch.get_num_threads()})


def machine_difference(recorded: dict, current: dict) -> str | None:
    """None if both identities agree, else what differs, e.g. "cpu_flags [avx2, fma] there, [...] here" (the CPU's
    family, model and stepping only where both record them: profiles before them did not)."""
    keys = [key for key in ("device", "gpu", "gpus", "offload", "cpu", "cpu_flags", "threads")
            if recorded.get(key) != current.get(key)]
    if recorded.get("cpu_id") and current.get("cpu_id") and recorded["cpu_id"] != current["cpu_id"]:
        keys.append("cpu_id")
    if not keys:
        return None
    return "; ".join(f"{key} {recorded.get(key)} there, {current.get(key)} here" for key in keys)


def machine_label(machine: dict) -> str:
    """A short name for a recorded machine: the GPU's, or the CPU's with its vector ISA and threads."""
    if machine.get("device") == "cuda" or machine.get("gpu"):
        label = f"{machine['gpus']} x {machine.get('gpu', 'GPU')}" if machine.get("gpus") else str(machine.get("gpu",
                                                                                                            "GPU"))
        if machine.get("offload"):
            label += f", {machine['offload']} offloaded over {machine.get('host_link')}"
        return label
    flags = machine.get("cpu_flags") or []
    isa = ("AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags
           else "no AVX2")
    return f"{machine.get('cpu', 'CPU')} ({isa}), {machine.get('threads', '?')} threads"
