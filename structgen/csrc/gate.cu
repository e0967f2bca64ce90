// The token gate: a captured CUDA graph wrapped in a conditional (IF) node whose condition a
// one-thread kernel decides on the device, after the launch.
//
// Why: with jump-forward at batch 1 the next decode forward waits for the host to read the
// sampled token and rule out forced text. Most decode steps of a JSON output are inside a
// string, where a sampled token without a quote, backslash or JSON punctuation cannot make the
// grammar force text, so the next forward can run at once. The host still checks; where it
// disagrees (forced text after all) that forward is wasted.

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace {

// A gate decided on the device, with no host in the loop: the body (the next decode step's
// forward) runs when the sequence's sampled row (`row`, read from the device: the step may
// have run forced tokens before it) is a grammar row and its sampled token is in `quiet`
// (tokens after which a free-text-like grammar state forces no text: no quote, backslash or
// JSON punctuation). The host launches it only for such states (a wide mask: inside a string).
// `check` = (row, token): where the row is >= 0 the step ran a guess after that row, and the
// last row's token counts only if the model picked the guess there (tokens[row] == token).
__global__ void token_gate_kernel(cudaGraphConditionalHandle handle, const int64_t* row, const int64_t* tokens,
                                  const int64_t* has_mask, const uint32_t* quiet, int64_t vocab,
                                  const int64_t* check) {
  const int64_t r = *row;
  const int64_t t = tokens[r];
  const bool is_quiet = t >= 0 && t < vocab && ((quiet[t >> 5] >> (t & 31)) & 1u);
  const bool guessed_ok = check[0] < 0 || tokens[check[0]] == check[1];
  cudaGraphSetConditional(handle, (has_mask[r] != 0 && is_quiet && guessed_ok) ? 1u : 0u);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// [kernel] -> IF(condition the kernel sets) { body }, instantiated. `kernel` runs on one
// thread with `args`, whose first entry points at `*handle_arg` (written here before the node
// copies the arguments). The body is copied in as a child graph: it keeps the captured graph's
// buffers (fixed addresses).
uintptr_t BuildIf(uintptr_t body, void* kernel, void** args, cudaGraphConditionalHandle* handle_arg) {
  cudaKernelNodeParams kp = {};
  kp.func = kernel;
  kp.gridDim = dim3(1, 1, 1);
  kp.blockDim = dim3(1, 1, 1);
  kp.kernelParams = args;
  cudaGraph_t graph;
  check(cudaGraphCreate(&graph, 0), "cudaGraphCreate");
  try {
    check(cudaGraphConditionalHandleCreate(handle_arg, graph, 0, cudaGraphCondAssignDefault),
          "cudaGraphConditionalHandleCreate");
    cudaGraphNode_t gate;
    check(cudaGraphAddKernelNode(&gate, graph, nullptr, 0, &kp), "gate: cudaGraphAddKernelNode");

    cudaGraphNodeParams cp = {};
    cp.type = cudaGraphNodeTypeConditional;
    cp.conditional.handle = *handle_arg;
    cp.conditional.type = cudaGraphCondTypeIf;
    cp.conditional.size = 1;
    cudaGraphNode_t cond;
#if CUDART_VERSION >= 13000
    check(cudaGraphAddNode(&cond, graph, &gate, nullptr, 1, &cp), "cudaGraphAddNode(conditional)");
#else
    check(cudaGraphAddNode(&cond, graph, &gate, 1, &cp), "cudaGraphAddNode(conditional)");
#endif
    cudaGraphNode_t child;
    check(cudaGraphAddChildGraphNode(&child, cp.conditional.phGraph_out[0], nullptr, 0,
                                     reinterpret_cast<cudaGraph_t>(body)),
          "body: cudaGraphAddChildGraphNode");

    cudaGraphExec_t exec;
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate(gated)");
    cudaGraphDestroy(graph);  // the executable keeps what it needs
    return reinterpret_cast<uintptr_t>(exec);
  } catch (...) {
    cudaGraphDestroy(graph);
    throw;
  }
}

}  // namespace

// Build and instantiate [token gate] -> IF(grammar row with a quiet token) { body }: device
// pointers to the sampled row's index (int64), the step's sampled tokens and has-mask flags
// (int64 a row), the quiet-token bitmask (uint32 words covering `vocab` ids) and the guess
// check (int64 row, token; row -1: no guess).
uintptr_t sg_token_gate_build(uintptr_t body, uintptr_t row, uintptr_t tokens, uintptr_t has_mask,
                              uintptr_t quiet, int64_t vocab, uintptr_t check) {
  cudaGraphConditionalHandle handle;
  const int64_t* row_arg = reinterpret_cast<const int64_t*>(row);
  const int64_t* token_arg = reinterpret_cast<const int64_t*>(tokens);
  const int64_t* has_mask_arg = reinterpret_cast<const int64_t*>(has_mask);
  const uint32_t* quiet_arg = reinterpret_cast<const uint32_t*>(quiet);
  const int64_t* check_arg = reinterpret_cast<const int64_t*>(check);
  void* args[] = {&handle, &row_arg, &token_arg, &has_mask_arg, &quiet_arg, &vocab, &check_arg};
  return BuildIf(body, reinterpret_cast<void*>(token_gate_kernel), args, &handle);
}

void sg_gate_destroy(uintptr_t exec) {
  check(cudaGraphExecDestroy(reinterpret_cast<cudaGraphExec_t>(exec)), "cudaGraphExecDestroy");
}
