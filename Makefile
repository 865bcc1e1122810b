# Makefile: switch.cu — GPT-2 and Switch-Transformer MoE training in raw C/CUDA.
# Two builds of the same .cu sources:
#   GPU:  nvcc, for sm_80 and sm_90 (override with GPU_ARCH=...)
#   CPU:  cpu/cucc, the CPU backend (g++ + OpenMP fibers + OpenBLAS + Open MPI); no GPU needed
# Targets:
#   make train_gpt     GPU trainer (nvcc); make train_gpt_cpu: the same on the CPU backend
#   make test_gpt      GPU test against the PyTorch reference; make test_gpt_cpu: CPU backend
#   make train_moe / train_moe_cpu / test_moe / test_moe_cpu: the same for the Switch-MoE trainer
#   make generate / generate_cpu: text generation with a paged KV cache (doc/inference.md)
#     PRECISION=BF16 (default) | FP16 | FP32, USE_CUDNN=1 (GPU only: cuDNN attention)
#   make test          build and run the whole test suite on the CPU backend (what CI runs), including the
#                      checking build (cpu/cucc --check) of the trainers' tests, of every lab and of the probes
#   make check-cuda    compile every .cu in the project with nvcc for sm_80 and sm_90 (compile only)
#   make bench         the CPU backend benchmark (fiber switch, launch, kernels, GEMM; what sharing the cores costs)
#   make clean
NVCC ?= nvcc
CUCC := cpu/cucc
GPU_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
NVCC_FLAGS ?= -std=c++17 -O3 --use_fast_math
# The CPU builds of the trainers, their tests and the labs take the GPU build's numerics flags (cpu/cucc emulates
# --use_fast_math's approximate functions and flushed subnormals in kernels: doc/backend.md, "Fast math"), at g++'s -O2
CPU_NUMERICS := $(filter-out -O%,$(NVCC_FLAGS))
MPI_INC := $(shell mpicxx --showme:compile 2>/dev/null)
BUILD := build
# every .cu compiles through cucc after a change to the backend
BACKEND := $(CUCC) cpu/Makefile $(wildcard cpu/*.cpp cpu/*.h cpu/include/*.h cpu/include/*/*.h)
TEST_COMMON := dev/test/test_common.h

PRECISION ?= BF16
ifeq ($(PRECISION),FP32)
PFLAGS := -DENABLE_FP32
else ifeq ($(PRECISION),FP16)
PFLAGS := -DENABLE_FP16
else ifeq ($(PRECISION),BF16)
PFLAGS :=
else
$(error PRECISION=$(PRECISION): expected BF16, FP16 or FP32)
endif
MPI_LINK := $(shell mpicxx --showme:link 2>/dev/null)
GPU_LIBS := -lcublas -lcublasLt -lnccl -lgomp $(MPI_LINK)
# the trainers' host code: OpenMP threads and a vectorisable sqrtf for the host AdamW of -oo 1 (llmc/adamw_host.h);
# cpu/cucc always compiles with -fopenmp (without -fno-math-errno that loop stays scalar: the same bits, slower)
GPU_HOST_FLAGS := -Xcompiler -fopenmp,-fno-math-errno
ifeq ($(USE_CUDNN),1)
GPU_CUDNN := -DENABLE_CUDNN -lcudnn
endif
LLMC := $(wildcard llmc/*.cuh llmc/*.h)
CPU_LIBS := -lcublas -lcublasLt -lnccl -lmpi

# The trainers and their tests. Each program's .cu and the project sources it includes:
PROGRAMS := train_gpt test_gpt train_moe test_moe generate
SOURCES_generate := generate.cu train_moe.cu train_gpt.cu
SOURCES_train_gpt := train_gpt.cu
SOURCES_test_gpt := test_gpt.cu train_gpt.cu
SOURCES_train_moe := train_moe.cu train_gpt.cu
SOURCES_test_moe := test_moe.cu train_moe.cu test_gpt.cu train_gpt.cu
# libraries a program links beside the backend's or the GPU's: generate's text prompts match GPT-2's pattern in PCRE2
LIBS_generate := -lpcre2-8
# build/NAME_PREC (PREC fp32, bf16 or fp16) -> NAME, and PREC's define
program_of = $(patsubst %_fp32,%,$(patsubst %_bf16,%,$(patsubst %_fp16,%,$(notdir $1))))
precision_flag = $(if $(filter %_fp32,$1),-DENABLE_FP32,$(if $(filter %_fp16,$1),-DENABLE_FP16))
.SECONDEXPANSION:

# GPU (nvcc) and CPU backend builds at PRECISION: ./train_gpt, ./train_gpt_cpu, ...
$(PROGRAMS): %: $$(SOURCES_$$*) $(LLMC)
	$(NVCC) $(NVCC_FLAGS) $(GPU_HOST_FLAGS) $(GPU_ARCH) $(PFLAGS) $(GPU_CUDNN) $(MPI_INC) $< -o $@ $(GPU_LIBS) \
	    $(LIBS_$*)
$(PROGRAMS:%=%_cpu): %_cpu: $$(SOURCES_$$*) $(LLMC) $(BACKEND)
	$(CUCC) -O2 $(CPU_NUMERICS) $(PFLAGS) $< -o $@ $(CPU_LIBS) $(LIBS_$*)

# what make test builds: every precision side by side, build/train_gpt_fp32 ... build/test_moe_fp16; the same
# through the checking build under build/check/ (cpu/README.md, "Checking mode"); and GPU builds under $(GPU_BUILD)/
# (what scripts/gpu_check.sh builds)
PRECISIONS := fp32 bf16 fp16
BUILT := $(foreach p,$(PROGRAMS),$(foreach q,$(PRECISIONS),$(BUILD)/$(p)_$(q)))
$(BUILT): $(BUILD)/%: $$(SOURCES_$$(call program_of,$$*)) $(LLMC) $(BACKEND) | $(BUILD)
	$(CUCC) -O2 $(CPU_NUMERICS) $(call precision_flag,$*) $< -o $@ $(CPU_LIBS) $(LIBS_$(call program_of,$*))
$(BUILT:$(BUILD)/%=$(BUILD)/check/%): $(BUILD)/check/%: $$(SOURCES_$$(call program_of,$$*)) $(LLMC) $(BACKEND)
	@mkdir -p $(dir $@)
	$(CUCC) --check -O2 $(CPU_NUMERICS) $(call precision_flag,$*) $< -o $@ $(CPU_LIBS) $(LIBS_$(call program_of,$*))
GPU_BUILD ?= $(BUILD)/gpu
$(BUILT:$(BUILD)/%=$(GPU_BUILD)/%): $(GPU_BUILD)/%: $$(SOURCES_$$(call program_of,$$*)) $(LLMC)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) $(GPU_HOST_FLAGS) $(GPU_ARCH) $(call precision_flag,$*) $(GPU_CUDNN) $(MPI_INC) $< -o $@ \
	    $(GPU_LIBS) $(LIBS_$(call program_of,$*))

# The BF16 trainers under --sanitize, and a data shard, for the production-size runs in edge mode
# (dev/test/test_production_runs.sh)
SANITIZED := $(BUILD)/sanitize/train_gpt_bf16 $(BUILD)/sanitize/train_moe_bf16
$(SANITIZED): $(BUILD)/sanitize/%: $$(SOURCES_$$(call program_of,$$*)) $(LLMC) $(BACKEND)
	@mkdir -p $(dir $@)
	$(CUCC) --sanitize -O1 $(CPU_NUMERICS) $(call precision_flag,$*) $< -o $@ $(CPU_LIBS)
$(BUILD)/prod/train.bin: train_gpt.py
	@mkdir -p $(dir $@)
	$(PYTHON) train_gpt.py --write-shard $@ --shard-tokens 262144 --V 263 --seed 7 >/dev/null

# The PyTorch reference states (doc/formats.md, "Debug state"): build/ref/NAME_{fp32,bf16}_debug_state.bin and
# its model file. GPT: tiny; MoE: one line per configuration, MOE_REF_<configuration> its flags. The tests take their
# settings from the state's header (the flags below). Both precisions of a configuration run the same seed: a BF16
# test routes by the bf16 reference's expert choices (teacher-forced routing, doc/moe.md), so near-ties that bf16
# rounding flips need no seed picked around them
PYTHON := /usr/bin/python3
REF_ARGS := --B 3 --T 23 --V 263 --L 2 --NH 3 --C 48 --maxT 32 --seed 1337 --steps 10 --grad-clip 0.5
MOE_REF_ARGS := $(REF_ARGS) --E 4 --H 96
ref_dtype = $(if $(filter %_fp32,$1),float32,bfloat16)
ref_config = $(patsubst %_fp32,%,$(patsubst %_bf16,%,$1))
# GPT at T = 1024 with a head size of 64 (attention at a real sequence length)
LONG_REF_ARGS := --B 1 --T 1024 --V 263 --L 2 --NH 2 --C 128 --maxT 1024 --seed 1337 --steps 10 --grad-clip 0.5
# GPT with 5 layers: ZeRO-2's gradient buckets (two, alternating between layers) are reused within a backward pass
DEEP_REF_ARGS := $(REF_ARGS) --L 5
# GPT with 8 layers: interleaved pipeline stages (-pp 4 -ppv 2: 8 chunks of one layer)
STAGES_REF_ARGS := $(REF_ARGS) --L 8
# the Llama-style model (-arch llama, doc/kernels.md) at the tiny shape with 4 heads of 16 (RoPE and flash attention
# want a head size of 16 to 128): gqa, 2 key/value heads and an own lm_head (the other values the defaults); tied,
# multi-head, the output embedding tied to wte, and theta, eps and H not the defaults
LLAMA_REF_ARGS := --B 3 --T 23 --V 263 --L 2 --NH 4 --C 64 --maxT 32 --seed 1337 --steps 10 --grad-clip 0.5 --arch llama
LLAMA_REF_gqa := --kv-heads 2
LLAMA_REF_tied := --tie-embeddings 1 --ffn-hidden 96 --rope-theta 500000 --norm-eps 1e-6
# top-1 with a capacity factor that drops, dropless, top-2 every other layer
MOE_REF_k1_cf0.5 := --topk 1 --moe-every 1 --cf 0.5
MOE_REF_k1_dropless := --topk 1 --moe-every 1 --cf 0
# 4 MoE layers: ZeRO-2's buckets (two per parameter set) are reused within a backward pass (its tests are FP32's)
MOE_REF_deep_k1 := --L 4 --topk 1 --moe-every 1 --cf 0.5
MOE_REF_k2_me2_cf0.5 := --topk 2 --moe-every 2 --cf 0.5
# router noise (doc/moe.md, "Router noise"): jitter with drops, noisy top-2 with drops, noisy top-1 with jitter
# dropless every other layer
MOE_REF_k1_jitter := --topk 1 --moe-every 1 --cf 0.5 --jitter 0.1
MOE_REF_k2_noisy := --topk 2 --moe-every 1 --cf 0.5 --noisy-topk 1
MOE_REF_k1_noisy_jitter := --topk 1 --moe-every 2 --cf 0 --noisy-topk 1 --jitter 0.05
# T = 1024 with a head size of 64, top-1 with drops (attention at a real sequence length)
MOE_REF_t1024_k1 := --B 1 --T 1024 --NH 2 --C 128 --maxT 1024 --topk 1 --moe-every 1 --cf 0.5
# sigmoid scores with a routed scale (doc/moe.md, "Routing options" 3 and 5): top-2 of 8
# experts dropless and with a capacity that drops; top-1 (its gate is the constant rsf: the router learns only
# through the balance losses) every other layer; and the routed scale on softmax gates
MOE_SIGMOID := --E 8 --score sigmoid --routed-scale 2.5
MOE_REF_k2_sigmoid_dropless := $(MOE_SIGMOID) --topk 2 --moe-every 1 --cf 0
MOE_REF_k2_sigmoid_cf1 := $(MOE_SIGMOID) --topk 2 --moe-every 1 --cf 1
MOE_REF_k1_sigmoid_me2 := $(MOE_SIGMOID) --topk 1 --moe-every 2 --cf 0
MOE_REF_k2_rsf_cf0.5 := --topk 2 --moe-every 1 --cf 0.5 --routed-scale 2.5
# the most experts the trainer takes (llmc/moe_common.cuh MOE_MAX_EXPERTS) with top-8 (fine-grained experts): 256
# experts of hidden size 16, sigmoid dropless and softmax with capacity factor 1 (capacity 3: about half the choices
# dropped). Among 256 scores the 8th and 9th of a token are often within bf16 rounding (seed 1337's smallest margins
# 1.7e-5 and 3.0e-6): a BF16 run routing by itself fails 10 of its 23 checks, and passes teacher-forced
MOE_REF_e256_k8_sigmoid := --E 256 --H 16 --topk 8 --moe-every 1 --cf 0 --score sigmoid --routed-scale 2.5
MOE_REF_e256_k8_cf1 := --E 256 --H 16 --topk 8 --moe-every 1 --cf 1
# shared experts (doc/moe.md, "Routing options" 2): one of hidden size 64 in the MoE layer of
# a dense-then-MoE model, top-1 with drops; two of hidden size 128 (their slices of a layer's gradient bucket
# outgrow a dense MLP's) with sigmoid top-2 of 8 dropless in every layer
MOE_REF_k1_shared_me2 := --topk 1 --moe-every 2 --cf 0.5 --shared-experts 1 --shared-hidden 64
MOE_REF_k2_sigmoid_shared2 := $(MOE_SIGMOID) --topk 2 --moe-every 1 --cf 0 --shared-experts 2 --shared-hidden 128
# aux-loss-free balancing (doc/moe.md, "Routing options" 4 and 6): sigmoid top-2 of 8
# dropless and top-1 with a capacity that drops (cf 0.5), the bias moving by 0.001 per step from the reference's
# N(0, 0.005) start, so that pass 0's choices already depend on it
MOE_REF_k2_bias_dropless := $(MOE_SIGMOID) --topk 2 --moe-every 1 --cf 0 --bias-gamma 0.001
MOE_REF_k1_bias_cf0.5 := $(MOE_SIGMOID) --topk 1 --moe-every 1 --cf 0.5 --bias-gamma 0.001
# device-limited routing (doc/moe.md, "Routing options" 9), each tested at -ep G on G processes
# (the groups are the expert-parallel members): always M < k, since with M >= k the k best experts lie in the M best
# groups and the limit changes nothing. Top-3 of 8 in 2 of 4 groups dropless, top-2 of 8 in 1 of 2 groups with a
# capacity that drops, and sigmoid top-2 of 8 in 1 of 4 groups (both experts of the group with the best key) with
# the balancing bias in the key
MOE_REF_k3_dl2_g4_dropless := --E 8 --topk 3 --moe-every 1 --cf 0 --device-limit 2 --ep-groups 4
MOE_REF_k2_dl1_g2_cf0.5 := --E 8 --topk 2 --moe-every 1 --cf 0.5 --device-limit 1 --ep-groups 2
MOE_REF_k2_bias_dl1_g4 := $(MOE_SIGMOID) --topk 2 --moe-every 1 --cf 0 --bias-gamma 0.001 --device-limit 1 \
    --ep-groups 4
# the sequence-wise balance loss (doc/moe.md, "Routing options" 7): sigmoid top-2 of 8 dropless
# beside the Switch loss (both alpha 0.01), and softmax top-1 with drops alone (Switch alpha 0, seq 0.05: the router's
# gradient has no other balance term that could hide a wrong one)
MOE_REF_k2_seq_sigmoid := $(MOE_SIGMOID) --topk 2 --moe-every 1 --cf 0 --seq-aux-alpha 0.01
MOE_REF_k1_seq_cf0.5 := --topk 1 --moe-every 1 --cf 0.5 --aux-alpha 0 --seq-aux-alpha 0.05
# the global-batch balance loss (doc/moe.md, "Routing options" 8) with one micro-batch: the
# Switch loss (test_moe -rg 1 on one process, and on several with the reference batch on each)
MOE_REF_k2_global_cf0.5 := --topk 2 --moe-every 1 --cf 0.5 --global-aux 1
# and with 2 micro-batches of 2 sequences per step (test_moe reads K from the debug state): top-2 of 8 with a
# capacity that drops, micro-batch 1's Switch loss reading micro-batch 0's counts too
MOE_REF_k2_global_mb2 := --B 4 --E 8 --topk 2 --moe-every 1 --cf 0.5 --global-aux 1 --micro-batches 2
# the routing options together at a tiny DeepSeek shape (train_moe.py's header): a llama MoE with sigmoid top-4 of 16
# experts in 2 of 4 groups, a shared expert, the balancing bias, the sequence-wise and global-batch losses, 3
# micro-batches of one sequence per step, dropless; tested at -ep 4 on 4 processes (the groups are the -ep members)
MOE_DS := --arch llama --NH 4 --C 64 --kv-heads 2 --E 16 --topk 4 --H 32 --shared-experts 1 --shared-hidden 64 \
    --score sigmoid --routed-scale 2.5 --bias-gamma 0.001 --seq-aux-alpha 0.001 --global-aux 1 --micro-batches 3 --cf 0
MOE_REF_ds := $(MOE_DS) --device-limit 2 --ep-groups 4
# and DeepSeek-V3's layout in place of the device limit, which has no -ep 1 to compare with: a dense layer first, then
# two MoE layers whose tokens keep 2 of the model's 4 expert groups by their two best affinity + bias; -ep 4 against
# -ep 1 with the bias, the three balance losses and 3 micro-batches per step
MOE_REF_ds_v3 := $(MOE_DS) --L 3 --first-dense 1 --expert-groups 4 --kept-groups 2
# the llama family (doc/moe.md, "Routing options and the llama MoE"): SwiGLU experts without biases,
# RMSNorm, RoPE and 2 key/value heads of 4 (head size 16, as LLAMA_REF_ARGS). The Mixtral shape (top-2 of 8 SwiGLU
# experts dropless in every layer) and a SwiGLU shared expert beside sigmoid top-2 of 4 with drops every other layer
MOE_LLAMA := --arch llama --NH 4 --C 64 --kv-heads 2
MOE_REF_llama_mixtral := $(MOE_LLAMA) --E 8 --topk 2 --H 64 --moe-every 1 --cf 0
MOE_REF_llama_shared := $(MOE_LLAMA) --topk 2 --H 64 --moe-every 2 --cf 0.5 --shared-experts 1 --shared-hidden 64 \
    --score sigmoid
# tensor parallelism with the MoE layers folded (doc/parallelism.md): the TP shape below with 2 micro-batches of 2
# sequences per step, which -tp 2 routes as its members' groups: GPT-2's top-2 of 4 with a capacity that drops, and
# a llama MoE with a SwiGLU shared expert beside sigmoid top-2 every other layer
MOE_REF_tp_k2_mb2 := --B 4 --T 24 --NH 4 --C 64 --topk 2 --moe-every 1 --cf 1 --micro-batches 2
MOE_REF_tp_llama_shared := $(MOE_LLAMA) --B 4 --T 24 --topk 2 --H 64 --moe-every 2 --cf 0.5 --shared-experts 1 \
    --shared-hidden 64 --score sigmoid --micro-batches 2
# and the routing options at that shape: noisy top-2 with jitter, dropless, with the sequence-wise loss; sigmoid top-2
# with the balancing bias and drops
MOE_REF_tp_noisy_jitter := --B 4 --T 24 --NH 4 --C 64 --topk 2 --moe-every 1 --cf 0 --noisy-topk 1 --jitter 0.05 \
    --seq-aux-alpha 0.01 --micro-batches 2
MOE_REF_tp_bias := --B 4 --T 24 --NH 4 --C 64 $(MOE_SIGMOID) --topk 2 --moe-every 1 --cf 0.5 --bias-gamma 0.001 \
    --micro-batches 2
# and the global-batch balance loss (-rg 1) over the step's 2 micro-batches of 8 experts with drops, which -etp 2 routes
# as the reference does (every member both micro-batches, one pass each)
MOE_REF_tp_global := --B 4 --T 24 --NH 4 --C 64 --E 8 --topk 2 --moe-every 1 --cf 0.5 --global-aux 1 --micro-batches 2
# tensor parallelism (doc/parallelism.md): GPT-2 and llama with 4 heads of 16 (2 key/value heads), H and the padded
# vocabulary 384 dividing by 4, and B*T = 96 tokens, which -sp 1 cuts into 2 or 4 equal parts
TP_REF_ARGS := --B 4 --T 24 --V 263 --L 2 --NH 4 --C 64 --maxT 32 --seed 1337 --steps 10 --grad-clip 0.5
TP_REF_gpt2 :=
TP_REF_llama := --arch llama --kv-heads 2
# loss masks (doc/formats.md, "Loss mask"): half the reference batch's targets hidden, for GPT-2 at the tiny shape,
# under tensor parallelism (the vocabulary-parallel classifier) and in an MoE of 3 micro-batches per step (whose
# shares of the targets that count differ)
MASK := --mask-fraction 0.5
TP_REF_gpt2_mask := $(MASK)
MOE_REF_mask_mb3 := --topk 2 --moe-every 1 --cf 0.5 --micro-batches 3 $(MASK)
# LoRA (-ft lora, llmc/model_adapter.h) at the tiny shape, the adapter's rank and alpha not the defaults (doc/formats.md,
# "Adapter file": the reference writes NAME_adapter.bin): GPT-2 on every layer's targets, and on the classifier (tied
# to wte: the adapter on it has no merged form); the llama model with its own lm_head on every target
LORA := --ft lora --ft-rank 8 --ft-alpha 12
LORA_REF_gpt2 := $(REF_ARGS) $(LORA) --ft-targets qkv,proj,fc,fc_proj
LORA_REF_gpt2_head := $(REF_ARGS) $(LORA) --ft-targets proj,lm_head
LORA_REF_llama := $(LLAMA_REF_ARGS) --kv-heads 2 $(LORA) --ft-targets qkv,proj,fc,fc_proj,lm_head
# bottleneck adapters (-ft adapter, llmc/bottleneck.cuh) of width 8 after every attention and FFN, GPT-2 and llama
ADAPTER_REF_gpt2 := $(REF_ARGS) --ft adapter --ft-rank 8
ADAPTER_REF_llama := $(LLAMA_REF_ARGS) --kv-heads 2 --ft adapter --ft-rank 8
# prompt tuning (-ft prompt, llmc/prompt.cuh): 5 virtual tokens before the 23 of every sequence (28 of maxT 32)
PROMPT_REF_gpt2 := $(REF_ARGS) --ft prompt --ft-rank 5
PROMPT_REF_llama := $(LLAMA_REF_ARGS) --kv-heads 2 --ft prompt --ft-rank 5
# prefix tuning (-ft prefix) and LLaMA-Adapter (-ft llama_adapter), llmc/prefix_attention.cuh: 5 shared keys and values
# in every layer; a 5-row prompt in both of GPT-2's layers and in llama's top one (-fl 1)
PREFIX_REF_gpt2 := $(REF_ARGS) --ft prefix --ft-rank 5
PREFIX_REF_llama := $(LLAMA_REF_ARGS) --kv-heads 2 --ft prefix --ft-rank 5
LLADAPTER_REF_gpt2 := $(REF_ARGS) --ft llama_adapter --ft-rank 5
LLADAPTER_REF_llama := $(LLAMA_REF_ARGS) --kv-heads 2 --ft llama_adapter --ft-rank 5 --ft-layers 1
# fine-tuning the MoE trainer (-ft, doc/training.md "The MoE trainer"), the routers and experts frozen with the model:
# LoRA on every target of a dense-then-MoE model (fc and fc_proj on its dense layer, the experts' pair on every expert),
# GPT-2's with experts padded to a capacity and llama's dropless with a SwiGLU shared expert; bottleneck adapters after
# the dense and the MoE FFN (with a shared expert); a prompt's virtual tokens routed as the real ones, a prefix and
# LLaMA-Adapter in every MoE layer's model
MOE_REF_lora := --topk 2 --moe-every 2 --cf 0.5 $(LORA) --ft-targets qkv,proj,fc,fc_proj,lm_head,experts
MOE_REF_llama_lora := $(MOE_LLAMA) --topk 2 --H 64 --moe-every 2 --cf 0 --shared-experts 1 --shared-hidden 64 \
    $(LORA) --ft-targets qkv,proj,fc,fc_proj,lm_head,experts
MOE_REF_adapter := --topk 2 --moe-every 2 --cf 0.5 --shared-experts 1 --shared-hidden 64 --ft adapter --ft-rank 8
MOE_REF_prompt := --topk 2 --moe-every 1 --cf 0.5 --ft prompt --ft-rank 5
MOE_REF_prefix := --topk 2 --moe-every 1 --cf 0.5 --ft prefix --ft-rank 5
MOE_REF_lladapter := --topk 2 --moe-every 1 --cf 0.5 --ft llama_adapter --ft-rank 5 --ft-layers 1
# ref_command NAME: the script and flags that write build/ref/NAME (NAME_debug_state.bin and NAME_model.bin): the
# family (the name's first word) gives the shape, a llama or MoE name's middle words its configuration (a variable of
# its own: a name without one is refused rather than built with the defaults), the last word the precision
ref_family = $(firstword $(subst _, ,$1))
ref_configured = $(if $(filter undefined,$(origin $1)),$(error build/ref/$2: the Makefile defines no $1),$($1))
REF_SCRIPTS_tiny := train_gpt.py
REF_SCRIPTS_long := train_gpt.py
REF_SCRIPTS_deep := train_gpt.py
REF_SCRIPTS_stages := train_gpt.py
REF_SCRIPTS_llama := train_gpt.py
REF_SCRIPTS_tp := train_gpt.py
REF_SCRIPTS_mask := train_gpt.py
REF_SCRIPTS_lora := train_gpt.py
REF_SCRIPTS_adapter := train_gpt.py
REF_SCRIPTS_prompt := train_gpt.py
REF_SCRIPTS_prefix := train_gpt.py
REF_SCRIPTS_lladapter := train_gpt.py
REF_SCRIPTS_moe := train_moe.py train_gpt.py
REF_FLAGS_tiny = $(REF_ARGS)
REF_FLAGS_long = $(LONG_REF_ARGS)
REF_FLAGS_deep = $(DEEP_REF_ARGS)
REF_FLAGS_stages = $(STAGES_REF_ARGS)
REF_FLAGS_mask = $(REF_ARGS) $(MASK)
REF_FLAGS_lora = $(call ref_configured,LORA_REF_$(call ref_config,$(1:lora_%=%)),$1)
REF_FLAGS_adapter = $(call ref_configured,ADAPTER_REF_$(call ref_config,$(1:adapter_%=%)),$1)
REF_FLAGS_prompt = $(call ref_configured,PROMPT_REF_$(call ref_config,$(1:prompt_%=%)),$1)
REF_FLAGS_prefix = $(call ref_configured,PREFIX_REF_$(call ref_config,$(1:prefix_%=%)),$1)
REF_FLAGS_lladapter = $(call ref_configured,LLADAPTER_REF_$(call ref_config,$(1:lladapter_%=%)),$1)
REF_FLAGS_llama = $(LLAMA_REF_ARGS) $(call ref_configured,LLAMA_REF_$(call ref_config,$(1:llama_%=%)),$1)
REF_FLAGS_tp = $(TP_REF_ARGS) $(call ref_configured,TP_REF_$(call ref_config,$(1:tp_%=%)),$1)
REF_FLAGS_moe = $(MOE_REF_ARGS) $(call ref_configured,MOE_REF_$(call ref_config,$(1:moe_%=%)),$1)
ref_scripts = $(or $(REF_SCRIPTS_$(call ref_family,$1)),$(error build/ref/$1: no reference family \
    '$(call ref_family,$1)' (expected tiny, long, deep, stages, mask, lora, adapter, prompt, prefix, lladapter, \
    llama, tp or moe)))
ref_command = $(firstword $(call ref_scripts,$1)) --write-reference $(BUILD)/ref/$1 \
    $(call REF_FLAGS_$(call ref_family,$1),$1) --dtype $(call ref_dtype,$1)
$(BUILD)/ref/%_debug_state.bin: $$(call ref_scripts,$$*) | $(BUILD)
	@mkdir -p $(BUILD)/ref
	$(PYTHON) $(call ref_command,$*)
# What the tests of dev/test/tests.txt use: every build/ path on a row or its "needs" line (a row with {lab} is the
# checked labs: CHECKED below), build/ref/NAME standing for that reference's debug state
TEST_TABLE := dev/test/tests.txt
TABLE_PATHS := $(sort $(shell awk '{ sub(/\#.*/, ""); for (i = 1; i <= NF; i++) \
    if ($$i ~ /^build\// && $$i !~ /[{]/) print $$i }' $(TEST_TABLE)))
TABLE_INPUTS := $(foreach f,$(TABLE_PATHS),$(if $(and $(filter $(BUILD)/ref/%,$(f)),$(filter-out %.bin,$(f))), \
    $(f)_debug_state.bin,$(f)))
# The table's references are written together, by one process that imports torch once
# (dev/test/write_references.py; one by one, importing torch was most of each one's 1.4 s)
TABLE_REFS := $(patsubst $(BUILD)/ref/%_debug_state.bin,%,$(filter $(BUILD)/ref/%_debug_state.bin,$(TABLE_INPUTS)))
define newline


endef
$(TABLE_REFS:%=$(BUILD)/ref/%_debug_state.bin) &: train_gpt.py train_moe.py dev/test/write_references.py | $(BUILD)
	@mkdir -p $(BUILD)/ref
	$(file >$(BUILD)/table_references.txt,$(foreach r,$(TABLE_REFS),$(call ref_command,$r)$(newline)))
	$(PYTHON) dev/test/write_references.py $(BUILD)/table_references.txt

# The CPU backend's own tests (cpu/test/), and the host utilities' test (dev/test/); both use dev/test/test_common.h
BACKEND_TESTS := $(BUILD)/test_runtime $(BUILD)/test_faults $(BUILD)/test_sanitize $(BUILD)/test_cublas \
                 $(BUILD)/test_nccl $(BUILD)/test_fast_math $(BUILD)/test_edge_blocks $(BUILD)/test_wmma
# the host AdamW (ZeRO-Offload) against the kernel: each precision with the GPU build's numerics, bf16 also exact
ADAMW_HOST_TESTS := $(BUILD)/test_adamw_host_bf16 $(BUILD)/test_adamw_host_fp16 $(BUILD)/test_adamw_host_fp32 \
                    $(BUILD)/test_adamw_host_exact_bf16
CPU_TESTS := $(BUILD)/test_host_utils $(ADAMW_HOST_TESTS) $(BACKEND_TESTS) $(BUILD)/test_runtime_sanitize $(BUILD)/test_runtime_ucontext \
             $(BUILD)/test_fast_math_fm $(BUILD)/test_edge_blocks_sanitize $(BUILD)/test_production_sizes \
             $(BUILD)/test_production_sizes_sanitize
# per test: the driver's mode and the libraries (default -O2, none)
TEST_MODE_test_sanitize := --sanitize -O1
TEST_MODE_test_runtime_sanitize := --sanitize -O1
TEST_MODE_test_runtime_ucontext := --ucontext -O2
TEST_LIBS_test_cublas := -lcublas -lcublasLt
TEST_LIBS_test_nccl := -lnccl -lmpi
TEST_LIBS_test_host_utils := -lnccl -lmpi -lpcre2-8
TEST_LIBS_test_edge_blocks := -lcublas -lcublasLt
test_mode = $(or $(TEST_MODE_$1),-O2)

.PHONY: all test test-inputs run-tests check-cuda bench clean labs checked
all: $(CPU_TESTS) $(BUILD)/bench

$(BUILD):
	@mkdir -p $(BUILD)

$(BACKEND_TESTS): $(BUILD)/%: cpu/test/%.cu $(TEST_COMMON) dev/test/sample_kernels.cuh $(BACKEND) | $(BUILD)
	$(CUCC) $(call test_mode,$*) -I dev/test $< -o $@ $(TEST_LIBS_$*)
$(BUILD)/test_runtime_sanitize $(BUILD)/test_runtime_ucontext: $(BUILD)/%: cpu/test/test_runtime.cu $(TEST_COMMON) \
        dev/test/sample_kernels.cuh $(BACKEND) | $(BUILD)
	$(CUCC) $(call test_mode,$*) -I dev/test $< -o $@
$(BUILD)/test_host_utils: $(BUILD)/%: dev/test/%.cu $(TEST_COMMON) $(LLMC) $(BACKEND) | $(BUILD)
	$(CUCC) $(call test_mode,$*) -I dev/test $< -o $@ $(TEST_LIBS_$*)
$(ADAMW_HOST_TESTS): $(BUILD)/test_adamw_host_%: dev/test/test_adamw_host.cu $(TEST_COMMON) $(LLMC) $(BACKEND) | $(BUILD)
	$(CUCC) -O2 -fno-math-errno $(if $(findstring exact,$*),,$(CPU_NUMERICS)) $(call precision_flag,$@) -I dev/test \
	    $< -o $@
# llmc kernels at production sizes in edge mode (dev/test/test_production_sizes.cu), plain and under the sanitizers
$(BUILD)/test_production_sizes: dev/test/test_production_sizes.cu $(TEST_COMMON) $(LLMC) $(BACKEND) | $(BUILD)
	$(CUCC) -O2 $(CPU_NUMERICS) -I dev/test $< -o $@ -lcublas -lcublasLt
$(BUILD)/test_production_sizes_sanitize: dev/test/test_production_sizes.cu $(TEST_COMMON) $(LLMC) $(BACKEND) | $(BUILD)
	$(CUCC) --sanitize -O1 $(CPU_NUMERICS) -I dev/test $< -o $@ -lcublas -lcublasLt
# test_fast_math built with nvcc's fast-math flags, test_edge_blocks under the sanitizers
$(BUILD)/test_fast_math_fm: cpu/test/test_fast_math.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	$(CUCC) -O2 --use_fast_math -I dev/test $< -o $@
$(BUILD)/test_edge_blocks_sanitize: cpu/test/test_edge_blocks.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	$(CUCC) --sanitize -O1 -I dev/test $< -o $@ -lcublas -lcublasLt
# the wmma emulation under the checking mode: its GEMMs must run clean, its misuse cases report as findings
$(BUILD)/check/test_wmma: cpu/test/test_wmma.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	@mkdir -p $(dir $@)
	$(CUCC) --check -O2 -I dev/test $< -o $@
$(BUILD)/bench: cpu/bench.cu $(BACKEND) | $(BUILD)
	$(CUCC) -O2 $< -o $@ -lcublas -lcublasLt

# make test works on a fresh machine: the dependencies first (scripts/install_deps.sh does nothing when they
# are present), then the build and the suite in a second make that sees them. make test T="NAME..." runs only
# the named tests (dev/test/run_tests.sh --list prints the names; shell patterns work), building what they use.
# It ends with the wall time of each phase: the dependencies, the builds, the tests. The builds run a job per core
# unless make was given -j itself.
TEST_BUILD_JOBS = $(if $(findstring jobserver,$(MAKEFLAGS)),,-j$(shell nproc))
test:
	@t0=$$(date +%s); scripts/install_deps.sh || exit $$?; t1=$$(date +%s); \
	$(if $(T),true,$(MAKE) --no-print-directory $(TEST_BUILD_JOBS) test-inputs) || exit $$?; t2=$$(date +%s); \
	dev/test/run_tests.sh $(T); rc=$$?; t3=$$(date +%s); \
	echo "make test: deps $$((t1 - t0)) s, builds $$((t2 - t1)) s, tests $$((t3 - t2)) s, in all $$((t3 - t0)) s"; \
	exit $$rc
test-inputs: $(CPU_TESTS) $(TABLE_INPUTS) checked
run-tests: test-inputs
	dev/test/run_tests.sh


# the kernel lab on the CPU backend, both precisions (make labs): each validates its variants at small sizes with -s,
# which make test runs in the labs' checking build below
LAB_SOURCES := $(sort $(filter-out dev/cuda/common.h,$(wildcard dev/cuda/*.cu)))
LAB_BINS := $(LAB_SOURCES:dev/cuda/%.cu=$(BUILD)/lab/%_bf16) $(LAB_SOURCES:dev/cuda/%.cu=$(BUILD)/lab/%_fp32)
# a lab's own host-compiler flags: the host AdamW vectorises only without C's errno semantics (llmc/adamw_host.h)
LAB_FLAGS_adamw_host := -fno-math-errno
labs: $(LAB_BINS)
$(LAB_BINS): $(BUILD)/lab/%: dev/cuda/$$(call program_of,$$*).cu $(wildcard dev/cuda/*.h) $(LLMC) $(BACKEND)
	@mkdir -p $(dir $@)
	$(CUCC) -O2 $(CPU_NUMERICS) $(LAB_FLAGS_$(call program_of,$*)) $(call precision_flag,$*) $< -o $@ -lcublas -lcublasLt

# The checking build (cpu/cucc --check; cpu/README.md, "Checking mode") of the trainers' tests and of every lab, which
# dev/test/run_tests.sh runs (the trainers' tests beside their plain twins); cpu/test/check/run_probes.sh builds its
# probes itself.
CHECKED := $(BUILD)/check/test_gpt_fp32 $(BUILD)/check/test_gpt_bf16 $(BUILD)/check/test_moe_fp32 \
           $(BUILD)/check/test_moe_bf16 $(BUILD)/check/test_wmma $(LAB_SOURCES:dev/cuda/%.cu=$(BUILD)/lab_check/%_bf16) \
           $(LAB_SOURCES:dev/cuda/%.cu=$(BUILD)/lab_check/%_fp32)
checked: $(CHECKED)
$(LAB_BINS:$(BUILD)/lab/%=$(BUILD)/lab_check/%): $(BUILD)/lab_check/%: dev/cuda/$$(call program_of,$$*).cu \
        $(wildcard dev/cuda/*.h) $(LLMC) $(BACKEND)
	@mkdir -p $(dir $@)
	$(CUCC) --check -O2 $(CPU_NUMERICS) $(LAB_FLAGS_$(call program_of,$*)) $(call precision_flag,$*) $< -o $@ \
	    -lcublas -lcublasLt

# the checking mode's probes as one program (cpu/test/check/run_probes.sh builds it, where out of date: here so that
# make test builds it beside the rest, not in its test's time)
$(BUILD)/check_probes/probes: $(wildcard cpu/test/check/*) $(BACKEND)
	cpu/test/check/run_probes.sh --build

bench: $(BUILD)/bench $(BUILD)/train_gpt_fp32 $(BUILD)/prod/train.bin
	$(BUILD)/bench
	cpu/bench_oversubscription.sh

# Compile-only GPU build of every .cu the project has (tracked or new), for both architectures.
# A checking-mode probe whose bug ptxas itself refuses says so on a line "// nvcc: refused ..." and is left out.
CUDA_SOURCES := $(sort $(filter-out $(shell grep -l '^// nvcc: refused' cpu/test/check/*.cu 2>/dev/null), \
                $(shell git ls-files --cached --others --exclude-standard '*.cu' 2>/dev/null)))
CUDNN_SOURCES := train_gpt.cu test_gpt.cu train_moe.cu test_moe.cu dev/cuda/flash_attention_forward.cu \
                 dev/cuda/flash_attention_backward.cu
# The checking mode's probes (cpu/test/check/, small programs) pass through nvcc as one translation unit
# (cpu/test/check/unity.sh): one at a time, nearly all of nvcc's time went to parsing the CUDA headers again.
CUDA_PROBES := $(filter cpu/test/check/%,$(CUDA_SOURCES))
CUDA_UNITS := $(filter-out $(CUDA_PROBES),$(CUDA_SOURCES))
check-cuda: $(CUDA_UNITS:%=$(BUILD)/check-cuda/%.ok) $(BUILD)/check-cuda/probes.cu.ok \
            $(CUDNN_SOURCES:%=$(BUILD)/check-cuda/cudnn/%.ok) $(BUILD)/check-cuda/no-device.ok
	@echo "check-cuda: $(words $(CUDA_SOURCES)) files compile with nvcc for: $(GPU_ARCH); $(CUDNN_SOURCES) also with USE_CUDNN=1 ($(CUDNN_ARCH))"
# the linked GPU binaries (the objects compiled above, linked as make train_gpt / test_gpt would), run where there is
# no GPU, must say so in one line and exit non-zero
$(BUILD)/check-cuda/no-device.ok: $(BUILD)/check-cuda/train_gpt.cu.ok $(BUILD)/check-cuda/test_gpt.cu.ok
	$(NVCC) $(GPU_HOST_FLAGS) $(GPU_ARCH) $(BUILD)/check-cuda/train_gpt.cu.o -o $(BUILD)/check-cuda/train_gpt $(GPU_LIBS)
	$(NVCC) $(GPU_HOST_FLAGS) $(GPU_ARCH) $(BUILD)/check-cuda/test_gpt.cu.o -o $(BUILD)/check-cuda/test_gpt $(GPU_LIBS)
	! $(BUILD)/check-cuda/train_gpt -e d2 > $(BUILD)/check-cuda/no-device.log 2>&1
	! $(BUILD)/check-cuda/test_gpt $(BUILD)/none >> $(BUILD)/check-cuda/no-device.log 2>&1
	test "$$(grep -c '^no CUDA device' $(BUILD)/check-cuda/no-device.log)" = 2
	@touch $@
# USE_CUDNN=1 adds host code only (cuDNN's graph API; no kernel), so its builds compile their device code, the plain
# builds' own, for the architecture of cuDNN's deterministic attention backward (Hopper) alone
CUDNN_ARCH := -gencode arch=compute_90,code=sm_90
$(BUILD)/check-cuda/cudnn/%.ok: % $(LLMC)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) $(CUDNN_ARCH) -DENABLE_CUDNN $(MPI_INC) -c $< -o $(@:.ok=.o)
	@touch $@
$(BUILD)/check-cuda/probes.cu: $(CUDA_PROBES) cpu/test/check/unity.sh
	@mkdir -p $(dir $@)
	@echo "cpu/test/check/unity.sh: the $(words $(CUDA_PROBES)) probes > $@"
	@cpu/test/check/unity.sh $(CUDA_PROBES) > $@
$(BUILD)/check-cuda/probes.cu.ok: $(BUILD)/check-cuda/probes.cu
	$(NVCC) $(NVCC_FLAGS) $(GPU_HOST_FLAGS) $(GPU_ARCH) -I . $(MPI_INC) -c $< -o $(@:.ok=.o)
	@touch $@
$(BUILD)/check-cuda/%.ok: % $(LLMC)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) $(GPU_HOST_FLAGS) $(GPU_ARCH) -I dev/test -I . $(MPI_INC) -c $< -o $(@:.ok=.o)
	@touch $@

clean:
	rm -rf $(BUILD) train_gpt train_gpt_cpu test_gpt test_gpt_cpu train_moe train_moe_cpu test_moe test_moe_cpu \
	    generate generate_cpu
	$(MAKE) -C cpu clean
