// cuda_bf16.h for the vllmini CPU emulator: everything lives in cuda_emu.h.
#include "cuda_emu.h"
