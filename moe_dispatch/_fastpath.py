"""What MoELayer's forward binds once: the checks of its fast path, read on every call.

Why a module of its own: at decode every line between two kernel calls runs cold (the
kernel has just streamed its weights through every cache), so each name here is bound once
at import, a global lookup instead of an attribute chain, and each check is the cheapest
form that keeps torch's semantics (measured figures below).
"""

from __future__ import annotations

import torch
import torch.nn.modules.module as _module

TENSOR = torch.Tensor
ID_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.float64))

is_compiling = torch.compiler.is_compiling
tracing_state = torch._C._get_tracing_state

# __call__'s cheaper form of is_compiling(), which calls torch.jit.is_scripting() (always
# False outside TorchScript) and then reads COMPILER's flag: 11 us per call when it runs
# cold, this form 4 us (measured on a Zen 4 after a 128 MiB read). Dynamo folds
# is_dynamo_compiling() to True while it traces, so it never reads the flag (a read would
# guard on it and recompile at every call: tests/test_compile_and_hooks.py); export and
# compile sessions set the flag.
dynamo_compiling = torch.compiler.is_dynamo_compiling
COMPILER: object = torch.compiler
if not hasattr(COMPILER, "_is_compiling_flag"):  # another torch: the public function

    class _Flag:
        _is_compiling_flag = property(lambda self: torch.compiler.is_compiling())

    COMPILER = _Flag()

# nn.Module's process-wide hook registries (mutated in place by register_module_*_hook).
GLOBAL_HOOKS = (_module._global_forward_hooks, _module._global_forward_pre_hooks,
                _module._global_backward_hooks, _module._global_backward_pre_hooks)
