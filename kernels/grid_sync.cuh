// A barrier of every block of a grid, for kernels launched cooperatively
// (cuLaunchCooperativeKernel: the driver runs all of the grid's blocks at
// once or refuses the launch, so no block waits for one that is not running).
// Never call it from a kernel launched any other way: its blocks need not be
// resident together, and the barrier could wait forever.
//
// `bar` is one 32-bit word of device memory, zero before the first launch
// that uses it, used by one launch at a time. Thread 0 of each block, once
// the block's threads have arrived (__syncthreads), makes the block's writes
// visible to the grid (__threadfence) and adds 2^31 - (blocks - 1) (block 0)
// or 1 (every other block); the additions total 2^31, so bit 31 of the word
// flips exactly when the last block adds its share (before that the sum of
// the shares is below 2^31), and the low 31 bits are zero again afterwards,
// ready for the next launch. Each thread 0 waits until bit 31 differs from
// the value its own addition returned (polling with a volatile load, which
// the compiler must issue again each time and may not hoist out of the
// loop, followed by a fence that orders the block's later reads after the
// poll saw the flip: the acquire), then the block's threads go on
// (__syncthreads); what any block wrote before the barrier is visible to
// every block after it.
//
// No engram kernel uses it since the decode kernel's last-block-done design
// (kernels/decode.cu); the SIMT self-test keeps it as its check of the
// shim's cooperative launches. Standalone (no engram_common.cuh).
#pragma once

__device__ __forceinline__ void eng_grid_sync(unsigned int *bar) {
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        const unsigned int blocks = gridDim.x * gridDim.y * gridDim.z;
        const bool first = blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
        const unsigned int share = first ? 0x80000000u - (blocks - 1u) : 1u;
        __threadfence();
        const unsigned int before = atomicAdd(bar, share);
        while (((*(volatile unsigned int *)bar ^ before) & 0x80000000u) == 0u) __nanosleep(64);
        __threadfence();
    }
    __syncthreads();
}
