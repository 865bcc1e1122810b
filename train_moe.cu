// train_moe.cu: Switch-Transformer Mixture-of-Experts training: the GPT-2 of train_gpt.cu whose MLP is, every
// `-me` layers, a Switch-MoE layer (router in fp32, top-k, capacity with dropping, dispatch, the experts as
// batched GEMMs, combine; load-balancing and z losses), with the same kernels, precision, recompute, ZeRO and
// checkpoints. Semantics and the model file: doc/moe.md. Build and run:
//   make train_moe [PRECISION=...]      GPU; make train_moe_cpu: the CPU backend
//   ./train_moe -e d12 -ne 8 -tk 1 -me 2 -i "data/x/*train*.bin" ...     (./train_moe -h lists the flags)
// The model, its passes and the training loop live in train_gpt.cu, included here without its main.
#define TRAIN_GPT_LIBRARY
#include "train_gpt.cu"

int main(int argc, char* argv[]) { return gpt2_main(argc, argv, TRAINER_MOE); }
