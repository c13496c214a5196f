"""Names the dead-code check (vulture) cannot see being used. Each group says how they are used.

Run as CI does: vulture zeroflow tests scripts experiments .ci/vulture_whitelist.py --min-confidence 60
"""
# ruff: noqa
from zeroflow.autocast.policy import AutocastPolicy
from zeroflow.memory.measure import MeasuredMemory
from zeroflow.xla.collectives import Collective

# Fields read through getattr by name (policy.py's _PRIMITIVE_FIELDS loop over them).
AutocastPolicy.fp32
AutocastPolicy.follow

# Record fields: written into reports and JSON through dataclasses.asdict / NamedTuple._asdict.
MeasuredMemory.generated_code_bytes
Collective.computation  # which HLO computation it is scheduled in (zf.memory.collectives)
_.log_tail  # scripts/benchlib/isolate.py: a case's result, printed by the GPU report

# Attributes third-party objects read: argparse's parser, tokenizers' Tokenizer, jinja2's
# Extension (its tags, and the method its parse() calls by name).
_.formatter_class
_.pre_tokenizer
_.decoder
_.post_processor
_.tags
_._marked

# jax.custom_jvp rules, registered by decorator (@f.defjvp).
_scatter_jvp
_stream_in_jvp
_gather_weight_jvp

# The GPU report's cases, named as "module:function" strings (scripts/gpureport/stages/).
correctness_cases
timing_cases
tile_cases
train_case
deviceless_case
deviceless_child
compile_fit_case
gemm_cases
step_cases

# A pytest fixture, requested by parameter name.
target_cudnn

# pytest hooks: pytest calls them by name (tests/conftest.py, tests/file_progress.py).
_.pytest_configure
_.pytest_collection_modifyitems
_.pytest_xdist_node_collection_finished
_.pytest_collection_finish
_.pytest_report_teststatus
_.pytest_runtest_logreport
_.pytest_xdist_auto_num_workers
_.pytest_report_header

# A test file's tier (pytest.mark.fast / slow): pytest reads a module's pytestmark by name.
pytestmark

# The public package's lazy names: Python calls a module's __getattr__ and __dir__ by name, and
# the package's class is set so that loading the autocast and lora sub-packages keeps
# zf.autocast and zf.lora the functions (zeroflow/__init__.py). A command's quiet jax import
# hands jax back its own loader (zeroflow/util/quiet_jax.py).
__getattr__
__dir__
_.__class__
_.__loader__
