// Stand-ins for the CUDA runtime on a CPU-only torch build, so that fake CUDA tensors
// (torch._subclasses.fake_tensor.FakeTensorMode) go through every Python binding and the autograd engine:
// - a device guard for CUDA (torch's own FakeGuardImpl: device and stream bookkeeping, no driver), which the
//   bindings of copy_, indexing and .to() take before dispatching;
// - CUDA hooks that say CUDA is built and present, which the autograd engine asks for the current stream.
// Nothing here allocates or computes: fake tensors hold no data. Loaded before torch is imported
// (genomelm/parallel/fake_cuda.py), since torch reads its CUDA hooks once.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
struct SimulatedCUDAHooks : public CUDAHooksInterface {
  explicit SimulatedCUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return 1; }
};
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, SimulatedCUDAHooks);
}  // namespace at

namespace {
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
}  // namespace
