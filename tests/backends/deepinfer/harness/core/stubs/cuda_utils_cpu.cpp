// Harness build of DeepInfer's deepinfer._C for a machine without CUDA: takes the place of csrc/cuda_utils.cpp,
// implementing the declarations of csrc/cuda_utils.hpp on host memory. Written for deepinfer-gateway's tests.
#include "cuda_utils.hpp"

#include <cstring>
#include <optional>

#include <torch/extension.h>

namespace deepinfer::cuda::utils {

std::optional<torch::Tensor> alloc_tensor(ssize_t size) {
    return torch::empty({size}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCPU));
}

void cuda_copy_async(void *dst, void *src, size_t size, uint64_t) { std::memmove(dst, src, size); }

uint64_t get_current_stream() { return 0; }

std::optional<torch::Tensor> import_ipc_tensor(py::bytes) {
    throw std::runtime_error("deepinfer-gateway CPU harness: CUDA IPC handles do not exist here");
}

py::bytes export_ipc_tensor(size_t, ssize_t) {
    throw std::runtime_error("deepinfer-gateway CPU harness: CUDA IPC handles do not exist here");
}

void pymodule_init(pybind11::module &m) {
    m.def("alloc_tensor", &alloc_tensor, py::arg("size"));
    m.def("export_ipc_tensor", &export_ipc_tensor, py::arg("ptr"), py::arg("nbytes"));
    m.def("import_ipc_tensor", &import_ipc_tensor, py::arg("data"));
}

}  // namespace deepinfer::cuda::utils
