"""Typed, nested run configuration.

Every field has a one-line doc (the string after it). YAML files fill these dataclasses; the
command line overrides them with dotted keys (``train.steps=100``). A section may hold a nested
section (``model.lora``, set with ``model.lora.rank=8`` or a mapping under ``lora:`` in YAML).
Loading and validation live in ``zeroflow.config.io``.

The allowed values of the engine's settings are the engine's own constants, kept free of jax in
``zeroflow.util.settings`` so that a config is checked before jax is imported; the model's are
spelled here, on ``ModelConfig``, and the model reads them back with ``choices_of`` (it imports
this module, so it cannot be imported from here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from zeroflow.engine.plan_rules import CONTEXT_CHUNKS
from zeroflow.util.settings import (
    ADAMW_CHOICES,
    AUTOCAST,
    DTYPE_NAMES,
    FP8_HISTORY,
    FP8_SCALINGS,
    FP8_SELECT,
    MASTER_DTYPES,
    OFFLOAD_CHOICES,
    QUANTIZE_GRADS_CHOICES,
    QUANTIZE_KINDS,
    QUANTIZE_WEIGHTS_CHOICES,
    REMAT_DTYPES,
    REMATS,
    UPDATE_ON_CHOICES,
    ZERO_STAGES,
)

CHOICES = "choices"
"Field-metadata key holding the allowed values of an enumerated field (checked by config_io)."


def one_of(*choices):
    """A dataclass field whose value must be one of ``choices``; the first one is the default."""
    return field(default=choices[0], metadata={CHOICES: tuple(choices)})


def choices_of(section_cls: type) -> dict[str, tuple]:
    """``{field name: allowed values}`` of the enumerated fields of a config section."""
    return {
        f.name: f.metadata[CHOICES]
        for f in dataclasses.fields(section_cls)
        if CHOICES in f.metadata
    }


@dataclass(unsafe_hash=True)  # hashable: model configs are cache keys (models.abstract_params)
class LoraConfig:
    rank: int = 0
    "Rank of the low-rank adapters (zf.lora); 0 = off. With a rank the base weights are frozen and only the adapters train."
    alpha: float = 8.0
    "Adapter scale alpha / rank (peft's LoraConfig default lora_alpha is 8)."
    targets: str = r"(attn|mlp)/\w+/kernel"
    "Regex (re.search) on parameter paths such as 'layers/attn/query/kernel': the weights that get adapters; the default takes every attention and MLP projection."
    dropout: float = 0.0
    "Dropout on the adapters' input (peft's lora_dropout); 0 disables it."
    quantize: str = one_of("none", *QUANTIZE_KINDS)
    "Storage of the frozen base weights (QLoRA): 'none' (the compute dtype), 'nf4' (4-bit NormalFloat, double-quantized scales: about 0.52 bytes a weight) or 'int8' (blocks of 64: 1.06 bytes); dequantized just before each use inside the step."


@dataclass
class ModelConfig:
    vocab_size: int = 256
    "Vocabulary size; 256 for byte-level tokens (set from the tokenizer when known)."
    seq_len: int = 128
    "Context length in tokens (also the training sequence length)."
    num_layers: int = 2
    "Number of decoder blocks (stacked with nn.scan)."
    embed_dim: int = 128
    "Model width (d_model)."
    num_heads: int = 4
    "Attention (query) heads."
    num_kv_heads: int = 0
    "Key/value heads for grouped-query attention; 0 means the same as num_heads."
    head_dim: int = 0
    "Per-head width; 0 means embed_dim // num_heads."
    mlp_dim: int = 512
    "Hidden width of the MLP."
    mlp_activation: str = one_of("swiglu", "gelu", "gelu_exact", "geglu")
    "MLP kind: 'swiglu', 'gelu' (tanh approximation, Hugging Face's gelu_new), 'gelu_exact' (erf) or 'geglu' (a gate as swiglu's, through the tanh-approximated gelu: Gemma)."
    norm: str = one_of("rmsnorm", "layernorm")
    "Normalisation: 'rmsnorm' or 'layernorm'."
    tie_embeddings: bool = True
    "Share the input embedding with the output projection."
    rope_base: float = 10000.0
    "Rotary position embedding base frequency."
    remat: str = one_of(*REMATS)
    "Rematerialisation policy for each block: 'none', 'full', 'save_dots', 'offload_dots' (save_dots's matmul outputs kept in pinned host memory) or 'offload_input' (as full, each layer's input kept in pinned host memory); both offloads keep them in device memory where host memory is the device's, as on XLA:CPU."
    remat_dtype: str = one_of(*REMAT_DTYPES)
    "What the remat policy keeps its saved activations in: 'compute' (the compute dtype) or 'fp8' (float8_e4m3fn bytes with one scale per tensor, dequantized for the backward pass): save_dots / offload_dots the matmul outputs (the forward pass reads the rounded values too), full / offload_input the layer inputs (the block's branches read the rounded input, the residual stream the exact one). remat 'none' takes 'compute'."
    loss_chunk: int = 0
    "Positions per tile of the chunked cross-entropy (zeroflow.ops.chunked_cross_entropy, its own backward pass), which never holds the [tokens, vocab] logits; 0 = the plain loss on the whole logits."
    loss_vocab_chunk: int = 8192
    "Vocabulary entries per tile of the chunked cross-entropy (model.loss_chunk > 0)."
    mlp_chunk: int = 0
    "Positions per chunk of the tiled MLP: each chunk runs under remat, so its [tokens, mlp_dim] intermediates are recomputed for the backward pass and never held for the whole sequence; 0 = untiled."
    layer_chunk: int = 0
    "Positions per chunk of each decoder layer's per-position work (norms, q/k/v and output projections, the MLP), each chunk under remat: the backward pass holds for the whole row only the layer input, q, k, v, the attention output and their gradients; needs remat 'none', 'full' or 'offload_input' and dropout 0, must divide the row; takes the place of mlp_chunk; 0 = one piece."
    attention: str = one_of("xla", "cudnn", "pallas")
    "Attention implementation: 'xla', 'cudnn' (GPU only) or 'pallas'."
    context_attention: str = one_of(*CONTEXT_CHUNKS)
    "How attention crosses the sequence split of parallel.context > 1: 'allgather' (every device's keys and values gathered, local queries) or 'ring' (key/value blocks passed around the devices with online softmax, in a load-balanced causal layout; attention 'xla' or 'pallas')."
    mlp: str = one_of("dense", "block_sparse")
    "MLP projections: 'dense' or 'block_sparse'."
    mlp_density: float = 0.25
    "Fraction of weight blocks kept when mlp is 'block_sparse'."
    mlp_block_size: int = 32
    "Block size of block-sparse MLP weights: 32, 64 or 128."
    dropout: float = 0.0
    "Dropout rate (0 disables it)."
    positions: str = one_of("rope", "learned")
    "Position information: 'rope' (rotary) or 'learned' (a table of max_positions vectors added to the embedding, as GPT-2)."
    max_positions: int = 0
    "Longest sequence the model supports (the learned position table's size; config.json's max_position_embeddings); 0 = seq_len."
    norm_eps: float = 1e-6
    "Epsilon added to the variance inside every norm."
    rope_scaling: str = one_of("none", "llama3", "linear")
    "Rotary frequency scaling: 'none', 'llama3' (Llama 3.1's long-context rescaling) or 'linear' (every frequency divided by rope_scaling_factor: Gemma 3's global layers)."
    rope_scaling_factor: float = 8.0
    "llama3 rope scaling: how much the low frequencies are slowed down; linear: the divisor of every frequency."
    rope_low_freq_factor: float = 1.0
    "llama3 rope scaling: wavelengths above original_max_positions / this are scaled fully."
    rope_high_freq_factor: float = 4.0
    "llama3 rope scaling: wavelengths below original_max_positions / this are kept."
    rope_original_max_positions: int = 8192
    "llama3 rope scaling: the context length the model was pretrained with."
    attn_bias: str = one_of("none", "qkv", "all")
    "Biases in attention: 'none', 'qkv' (query/key/value, as Qwen2) or 'all' (also the output projection)."
    mlp_bias: bool = False
    "Biases on the MLP projections (GPT-2)."
    sliding_window: int = 0
    "Attend to at most this many most recent tokens, the current one included (Mistral); 0 = all."
    global_every: int = 0
    "With sliding_window: every global_every-th layer (layers global_every - 1, 2 * global_every - 1, ...) attends to the whole sequence and the others use the window (Gemma 2: 2, Gemma 3: 6); 0 = the window in every layer."
    local_rope_base: float = 0.0
    "Rotary base of the sliding-window layers when global_every > 0 (Gemma 3: 10,000); they take no rope_scaling; 0 = rope_base."
    qk_norm: bool = False
    "RMSNorm (with norm_eps and norm_offset) on each head's queries and keys before the rotary embedding (Qwen3, Gemma 3)."
    norm_offset: float = 0.0
    "Added to every norm's learned scale, which then starts at 1 - norm_offset (Gemma: 1.0, the scale stored as w and applied as 1 + w)."
    post_norms: bool = False
    "Also normalise the attention and MLP outputs before they join the residual stream (Gemma 2 and 3)."
    scale_embeddings: bool = False
    "Multiply the input embeddings by sqrt(embed_dim), rounded to the compute dtype (Gemma)."
    query_pre_attn_scalar: float = 0.0
    "Attention scores are scaled by 1 / sqrt(this) instead of 1 / sqrt(head_dim) (Gemma); 0 = head_dim."
    attn_softcap: float = 0.0
    "Attention scores soft-capped to cap * tanh(score / cap) before the softmax (Gemma 2); 0 = off. Needs attention='xla' and no context axis."
    logit_softcap: float = 0.0
    "Output logits soft-capped to cap * tanh(logit / cap) (Gemma 2); 0 = off. Needs loss_chunk=0."
    init_from: str = ""
    "A Hugging Face checkpoint folder (config.json + safetensors) to start from; its config.json then fixes the architecture fields of this section (all but seq_len, remat, remat_dtype, attention, dropout, the loss and MLP chunks, lora)."
    lora: LoraConfig = field(default_factory=LoraConfig)
    "Low-rank adapters (model.lora.rank > 0): a nested section."


@dataclass
class DataConfig:
    source: str = "stdlib"
    "Where text comes from: 'stdlib' (the interpreter's standard library .py files), a path to a text file or folder, or a .bin token file made by scripts/prepare_data.py; with a records data.format, a .jsonl/.json/.parquet file, a folder of them, or a datasets save_to_disk folder."
    val_fraction: float = 0.05
    "Fraction held out for validation, deterministic: of files (split by file name), or of records (by file and line)."
    max_bytes: int = 0
    "Cap on corpus bytes read (0 = no cap; data.format=stream only)."
    tokenizer: str = "byte"
    "'byte' for byte-level tokens; a SentencePiece .model path; a Hugging Face tokenizer.json or a folder holding one."
    format: str = one_of("stream", "text", "prompt_completion", "chat")
    "'stream': text or token files read as one token stream; records (a .jsonl/.json/.parquet file or folder, or a datasets save_to_disk folder), one example each, packed: 'text' (a text field), 'prompt_completion' or 'chat' (messages rendered with the tokenizer's chat template)."
    text_field: str = "text"
    "format=text: the field holding the text."
    prompt_field: str = "prompt"
    "format=prompt_completion: the field holding the prompt."
    completion_field: str = "completion"
    "format=prompt_completion: the field holding the completion."
    messages_field: str = "messages"
    "format=chat: the field holding the list of {role, content} messages."
    train_on: str = one_of("completion", "all")
    "Records: the tokens the loss trains on: 'completion' (the completion, or the assistant turns the chat template marks with {% generation %}) or 'all'."
    bad_records: str = one_of("skip", "stop")
    "Records that cannot be used (missing fields, wrong types, empty, longer than seq_len): 'skip' them and report the count, or 'stop' at the first."
    packing_bins: int = 64
    "Records: examples are packed best-fit into this many open rows before they are emitted (more: fuller rows)."


@dataclass
class TrainConfig:
    steps: int = 300
    "Number of optimizer steps."
    batch_size: int = 16
    "Global batch size in sequences (split over the data axis and grad_accum)."
    lr: float = 3e-3
    "Peak learning rate."
    min_lr_ratio: float = 0.1
    "Final learning rate as a fraction of the peak (cosine decay)."
    warmup_steps: int = 20
    "Linear warmup steps."
    weight_decay: float = 0.1
    "AdamW weight decay (masked off norms and biases)."
    b1: float = 0.9
    "Adam beta1."
    b2: float = 0.95
    "Adam beta2."
    grad_clip: float = 1.0
    "Global gradient-norm clip (0 disables it)."
    optimizer: str = one_of(*ADAMW_CHOICES)
    "AdamW with fp32 moments ('adamw', 8 bytes per parameter), blockwise 8-bit ('adamw_8bit', about 2) or bf16 ('adamw_bf16', 4)."
    seed: int = 0
    "Seed for parameters and data order."
    log_every: int = 10
    "Steps between metric lines in metrics.jsonl."
    eval_every: int = 100
    "Steps between evaluations (0 = only at the end)."
    eval_batches: int = 4
    "Validation batches per evaluation."
    freeze: str = ""
    "Regex (re.search) on parameter paths such as 'layers/attn/q_proj': matching parameters are frozen (kept once in the compute dtype: no master copy, optimizer state or gradient); '' trains all."
    eval_only: bool = False
    "Only evaluate: the latest checkpoint of run.dir (else the initial weights, e.g. model.init_from's), on eval_batches held-out batches; nothing is trained or written."
    on_divergence: str = one_of("rollback", "stop")
    "When a step diverges (non-finite loss or gradients, a loss spike, a gradient norm over max_grad_norm): 'rollback' restores the newest healthy checkpoint, skips the batches since it and trains on (default: a long run recovers unattended, as people did by hand, and max_rollbacks bounds it), or 'stop' with one line naming that checkpoint."
    spike_factor: float = 3.0
    "A step whose loss exceeds this times the median of the last spike_window losses diverges (0 = no spike check); 3 stays clear of batch-to-batch noise."
    spike_window: int = 50
    "How many recent training losses the spike check's median is taken over."
    max_grad_norm: float = 0.0
    "A step whose gradient norm (before clipping) exceeds this diverges; 0 = no bound (norms depend on the model)."
    rollback_lr_factor: float = 1.0
    "Each rollback multiplies the learning-rate schedule by this (in (0, 1]; 1 = skip the batches only)."
    max_rollbacks: int = 3
    "Rollbacks a run may make; the divergence after the last one stops the run."


@dataclass
class ParallelConfig:
    data: int = -1
    "Devices on the data axis (-1 = all remaining)."
    model: int = 1
    "Devices on the model (tensor-parallel) axis."
    context: int = 1
    "Devices each sequence is split over (the context axis; ZeRO shards states over data x context); model.context_attention says how attention crosses the split."
    zero_stage: int = one_of(*ZERO_STAGES)
    "ZeRO stage 0, 1, 2 or 3."
    grad_accum: int = 1
    "Micro-batches per step."
    offload: str = one_of(*OFFLOAD_CHOICES)
    "Host offload: 'none', 'optimizer' or 'optimizer+params'."
    update_on: str = one_of(*UPDATE_ON_CHOICES)
    "Where the offloaded optimizer update runs: 'device' or 'host'."
    quantize_weights: str = one_of("none", *QUANTIZE_WEIGHTS_CHOICES[1:])
    "ZeRO++ qwZ at stage 3: weights all-gathered as int8 blocks ('int8') or in the compute dtype."
    quantize_block: int = 256
    "Entries per int8 block (one fp32 scale each) when quantize_weights or quantize_grads is 'int8'."
    hierarchical: bool = False
    "ZeRO++ hpZ at stage 3: a bf16 weight copy per host, so weight gathers stay inside the host."
    quantize_grads: str = one_of("none", *QUANTIZE_GRADS_CHOICES[1:])
    "ZeRO++ qgZ at stage 3: gradients reduce-scattered as int8 ('int8'), within then across hosts."
    hosts: int = 0
    "Hosts the data axis spans, for emulated devices of one process (0: each device's own host)."

    def plan_settings(self) -> dict:
        """The ``ZeroPlan`` arguments these keys set ('none' and ``hosts=0`` read as None): the
        trainer's plan is built from them, and the validation checks the plan's rules on them."""
        return dict(
            stage=self.zero_stage,
            offload=self.offload,
            update_on=self.update_on,
            quantize_weights=None if self.quantize_weights == "none" else self.quantize_weights,
            quantize_block=self.quantize_block,
            hierarchical=self.hierarchical,
            quantize_grads=None if self.quantize_grads == "none" else self.quantize_grads,
            hosts=self.hosts or None,
        )


@dataclass
class PrecisionConfig:
    params: str = one_of(*DTYPE_NAMES)
    "Compute weight dtype: 'fp32', 'bf16' or 'fp16'."
    master: str = one_of(*MASTER_DTYPES)
    "Master weight dtype (fp32)."
    loss_scale: str = "none"
    "'none', 'dynamic' or a number (static scale)."
    autocast: str = one_of(*AUTOCAST)
    "Run the unmodified model under zf.autocast: 'none', 'bf16', 'fp16' (needs loss_scale) or 'fp8'."
    reduce: str = one_of(*DTYPE_NAMES)
    "Dtype gradients are summed over devices in: 'fp32' (exact) or the params dtype (half the bytes)."
    init_scale: float = 32768.0
    "Starting scale of dynamic loss scaling."
    growth_interval: int = 2000
    "Clean steps after which a dynamic loss scale doubles."
    min_scale: float = 1.0
    "A dynamic loss scale never halves below this."
    max_consecutive_skips: int = 20
    "Consecutive skipped steps (non-finite gradients) after which a dynamically scaled run stops."
    fp8_scaling: str = one_of(*FP8_SCALINGS)
    "autocast=fp8: 'tensor' or 'row' scales of the e4m3 operands (current scaling), or 'delayed' (from an amax history kept in the train state and checkpointed)."
    fp8_select: str = one_of(*FP8_SELECT)
    "autocast=fp8: which matmuls run in FP8, 'cost' (roofline model) or 'all' eligible ones."
    fp8_history: int = FP8_HISTORY
    "fp8_scaling=delayed: steps of amax history per tensor."
    fp8_margin: int = 0
    "fp8_scaling=delayed: the scale leaves 2**margin of headroom above the history's largest amax."


@dataclass
class CheckpointConfig:
    every: int = 0
    "Steps between checkpoints (0 = only at the end and on SIGTERM/SIGINT)."
    keep: int = 3
    "How many recent checkpoints to keep."
    keep_every: int = 0
    "Also keep every step that is a multiple of this (0 = none beyond checkpoint.keep); a multiple of checkpoint.every. The newest verified step is never deleted."
    async_save: bool = True
    "Write checkpoints in the background: training waits only for the copy of the state to host memory; the files and their digests are written while it goes on (one save in flight at a time)."
    dir: str = ""
    "Folder of the checkpoints ('' = run.dir/checkpoints), e.g. on a shared file system; sample and export read it from the run's config.yaml."
    allow_unverified: bool = False
    "Load a step that has no digests even where the run has digested steps (a step without them is otherwise treated as damaged: moved aside, the older verified step used)."


@dataclass
class RunConfig:
    dir: str = "runs/tiny"
    "Output folder: resolved config, metrics.jsonl, checkpoints/."
    tensorboard: bool = True
    "Write TensorBoard event files to run.dir/tb (view with: tensorboard --logdir run.dir/tb)."
    plot: bool = True
    "Write run.dir/plot.png (training and held-out loss, tokens/s) at the end, and at an evaluation when it is over a minute old."
    wandb: str = one_of("off", "offline", "online")
    "Also log to Weights & Biases: 'offline' writes run.dir/wandb/ (upload later with 'wandb sync'), 'online' needs a login; pip install zeroflow[wandb]."
    trackio: bool = False
    "Also log to trackio (local-first: a database under TRACKIO_DIR, no account; view with 'trackio show'); pip install zeroflow[trackio]."
    project: str = "zeroflow"
    "Project name under which Weights & Biases and trackio file the run (the run's name is run.dir's folder name)."
    progress: bool = True
    "Show a progress bar."


@dataclass
class FuseMixConfig:
    enabled: bool = False
    "Train FuseMix adapters on two frozen encoders' cached latents instead of the GPT (model.* and data.* are then unused; docs/fusemix.md)."
    dataset: str = one_of("digits")
    "Paired data: 'digits' (scikit-learn's 1,797 handwritten 8x8 digits with generated captions)."
    image_encoder: str = ""
    "Hugging Face folder of the frozen image encoder (CLIPVisionModel)."
    text_encoder: str = ""
    "Hugging Face folder of the frozen text encoder (BertModel) with its tokenizer.json."
    tiny_encoders: bool = False
    "The CPU demo's encoders: where image_encoder or text_encoder names a folder that does not exist yet (or is empty), write a tiny randomly initialised CLIP vision model or BERT there (seeded, nothing downloaded; needs torch and transformers) instead of stopping."
    image_pooling: str = one_of("pooled", "mean")
    "Image latent: the encoder's pooled output (CLIP: the class token after the final norm) or the mean of its last hidden states."
    text_pooling: str = one_of("cls", "mean")
    "Text latent: the [CLS] token's hidden state (BGE) or the mean over real tokens (E5)."
    max_text_len: int = 16
    "Tokens per caption, padding included."
    cache: str = ""
    "Folder of the latent cache (one subfolder per encoder); '' = run.dir/latents."
    encode_dtype: str = one_of("bf16", "fp32", "fp16")
    "Dtype the encoders run in while the cache is built."
    encode_batch: int = 256
    "Rows per encoding batch (rounded up to a multiple of the devices)."
    val_pairs: int = 360
    "Held-out pairs for retrieval evaluation (never trained on)."
    shared_dim: int = 64
    "Width of the shared embedding space."
    adapter: str = one_of("mlp", "residual")
    "Each adapter: 'mlp' (adapter_layers Dense layers of adapter_hidden, the last into the shared space) or 'residual' (the FuseMix paper's: adapter_layers pre-norm residual blocks widened adapter_expansion times, a LayerNorm and a Dense into the shared space)."
    adapter_hidden: int = 256
    "adapter=mlp: hidden width of each adapter MLP."
    adapter_layers: int = 2
    "Dense layers per adapter (the last one projects into the shared space); adapter=residual: residual blocks per adapter."
    adapter_expansion: int = 4
    "adapter=residual: how many times each block's hidden layer widens the latent."
    temperature: float = 0.07
    "InfoNCE temperature."
    mixup_alpha: float = 1.0
    "Latent mixup: lambda ~ Beta(alpha, alpha), one per pair, shared by its image and text; 0 disables mixup."
    prefetch: int = 2
    "Batches copied to the devices ahead of the step that uses them."


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    fusemix: FuseMixConfig = field(default_factory=FuseMixConfig)
