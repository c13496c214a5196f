"""The environment variables that describe one process of a multi-process job: plain names, no
jax, so that ``python -m zeroflow.launch`` sets them without importing jax
(``zeroflow.engine.distributed`` reads them)."""

ENV_COORDINATOR = "ZEROFLOW_COORDINATOR"
ENV_NUM_PROCESSES = "ZEROFLOW_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROFLOW_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "ZEROFLOW_LOCAL_DEVICE_IDS"
ENV_DISTRIBUTED = "ZEROFLOW_DISTRIBUTED"
