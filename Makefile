# Makefile: switch.cu — GPT-2 and Switch-Transformer MoE training in raw C/CUDA.
# Two builds of the same .cu sources:
#   GPU:  nvcc, for sm_80 and sm_90 (override with GPU_ARCH=...)
#   CPU:  cpu/cucc, the CPU backend (g++ + OpenMP fibers + OpenBLAS + Open MPI); no GPU needed
# Targets:
#   make test          build and run the whole test suite on the CPU backend (what CI runs)
#   make check-cuda    compile every .cu in the project with nvcc for sm_80 and sm_90 (compile only)
#   make bench         the CPU backend benchmark (fiber switch, launch, kernels, GEMM)
#   make clean
NVCC ?= nvcc
CUCC := cpu/cucc
GPU_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
NVCC_FLAGS ?= -std=c++17 -O3 --use_fast_math
MPI_INC := $(shell mpicxx --showme:compile 2>/dev/null)
BUILD := build
# every .cu compiles through cucc after a change to the backend
BACKEND := $(CUCC) cpu/Makefile $(wildcard cpu/*.cpp cpu/include/*.h cpu/include/*/*.h)
TEST_COMMON := dev/test/test_common.h

CPU_TESTS := $(BUILD)/test_runtime $(BUILD)/test_runtime_sanitize $(BUILD)/test_runtime_ucontext \
             $(BUILD)/test_faults $(BUILD)/test_sanitize $(BUILD)/test_cublas $(BUILD)/test_nccl

.PHONY: all test check-cuda bench clean
all: $(CPU_TESTS) $(BUILD)/bench

$(BUILD):
	@mkdir -p $(BUILD)

$(BUILD)/test_runtime: dev/test/test_runtime.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	$(CUCC) -O2 -I dev/test $< -o $@
$(BUILD)/test_runtime_sanitize: dev/test/test_runtime.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	$(CUCC) --sanitize -O1 -I dev/test $< -o $@
$(BUILD)/test_runtime_ucontext: dev/test/test_runtime.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	$(CUCC) --ucontext -O2 -I dev/test $< -o $@
$(BUILD)/test_faults: dev/test/test_faults.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	$(CUCC) -O2 -I dev/test $< -o $@
$(BUILD)/test_sanitize: dev/test/test_sanitize.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	$(CUCC) --sanitize -O1 -I dev/test $< -o $@
$(BUILD)/test_cublas: dev/test/test_cublas.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	$(CUCC) -O2 -I dev/test $< -o $@ -lcublas -lcublasLt
$(BUILD)/test_nccl: dev/test/test_nccl.cu $(TEST_COMMON) $(BACKEND) | $(BUILD)
	$(CUCC) -O2 -I dev/test $< -o $@ -lnccl -lmpi
$(BUILD)/bench: cpu/bench.cu $(BACKEND) | $(BUILD)
	$(CUCC) -O2 $< -o $@ -lcublas -lcublasLt

test: $(CPU_TESTS)
	dev/test/run_tests.sh

bench: $(BUILD)/bench
	$(BUILD)/bench

# Compile-only GPU build of every .cu the project has (tracked or new), for both architectures.
CUDA_SOURCES := $(sort $(shell git ls-files --cached --others --exclude-standard '*.cu' 2>/dev/null))
check-cuda: $(CUDA_SOURCES:%=$(BUILD)/check-cuda/%.ok)
	@echo "check-cuda: $(words $(CUDA_SOURCES)) files compile with nvcc for: $(GPU_ARCH)"
$(BUILD)/check-cuda/%.ok: %
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) $(GPU_ARCH) -I dev/test -I . $(MPI_INC) -c $< -o $(@:.ok=.o)
	@touch $@

clean:
	rm -rf $(BUILD)
	$(MAKE) -C cpu clean
