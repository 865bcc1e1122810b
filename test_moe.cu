// test_moe.cu: the MoE trainer against the PyTorch reference (train_moe.py): for one model and batch written by
//   /usr/bin/python3 train_moe.py --write-reference PREFIX ...
// the logits, the cross-entropy, the aux and z losses, the routing (choices per expert, drops), every
// parameter gradient (router and experts included) and the losses of 10 AdamW steps on that batch.
//   make test_moe_cpu; ./test_moe_cpu PREFIX [-r 0|1|2] [-w 0|1] [-ge 0|1|2] [-cf CF] [-ra A] [-rz Z]
// (-cf, -ra, -rz: the values the reference was written with). The test itself is test_gpt.cu's, included
// here without its main; its tolerances are stated there.
#define TEST_GPT_LIBRARY
#include "test_gpt.cu"

int main(int argc, char** argv) { return test_main(argc, argv, 1); }
