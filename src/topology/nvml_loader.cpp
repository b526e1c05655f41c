#include "topology/nvml_loader.h"

#include <dlfcn.h>

#include <climits>
#include <cstring>
#include <functional>

#include "topology/pcie_path.h"

namespace loom::topo::detail {

namespace {

// The parts of nvml.h used here (NVML API, stable ABI; _v2/_v3 entry points where they exist).
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t NVML_SUCCESS = 0;
constexpr unsigned NVML_NVLINK_MAX_LINKS = 18;
constexpr int NVML_FEATURE_ENABLED = 1;
struct nvmlPciInfo_t {
  char busIdLegacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[32];
};

using InitFn = nvmlReturn_t (*)();
using ShutdownFn = nvmlReturn_t (*)();
using ErrorStringFn = const char* (*)(nvmlReturn_t);
using GetCountFn = nvmlReturn_t (*)(unsigned int*);
using GetHandleFn = nvmlReturn_t (*)(unsigned int, nvmlDevice_t*);
using GetNameFn = nvmlReturn_t (*)(nvmlDevice_t, char*, unsigned int);
using GetPciInfoFn = nvmlReturn_t (*)(nvmlDevice_t, nvmlPciInfo_t*);
using GetNvLinkStateFn = nvmlReturn_t (*)(nvmlDevice_t, unsigned int, int*);
using GetNvLinkRemotePciFn = nvmlReturn_t (*)(nvmlDevice_t, unsigned int, nvmlPciInfo_t*);
using GetCpuAffinityFn = nvmlReturn_t (*)(nvmlDevice_t, unsigned int, unsigned long*);
using GetCommonAncestorFn = nvmlReturn_t (*)(nvmlDevice_t, nvmlDevice_t, int*);

class Library {
 public:
  explicit Library(const std::string& path) : handle_(dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) {}
  ~Library() {
    if (handle_) dlclose(handle_);
  }
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;
  explicit operator bool() const { return handle_ != nullptr; }
  template <typename Fn>
  Fn symbol(std::initializer_list<const char*> names) const {
    for (const char* name : names)
      if (void* p = dlsym(handle_, name)) return reinterpret_cast<Fn>(p);
    return nullptr;
  }

 private:
  void* handle_;
};

std::string bus_id_of(const nvmlPciInfo_t& pci) {
  char text[sizeof(pci.busId) + 1] = {};
  std::memcpy(text, pci.busId, sizeof(pci.busId));
  if (text[0] == '\0') std::memcpy(text, pci.busIdLegacy, sizeof(pci.busIdLegacy));
  return normalize_bus_id(text);
}

}  // namespace

}  // namespace loom::topo::detail

namespace loom::topo {

std::optional<GpuGauges> read_gpu_gauges(unsigned index, std::string& why) {
  using namespace detail;  // the NVML declarations and the library loader above
  struct Utilization {
    unsigned int gpu, memory;
  };
  struct Memory {
    unsigned long long total, free, used;
  };
  using UtilizationFn = nvmlReturn_t (*)(nvmlDevice_t, Utilization*);
  using MemoryFn = nvmlReturn_t (*)(nvmlDevice_t, Memory*);
  using TemperatureFn = nvmlReturn_t (*)(nvmlDevice_t, int, unsigned int*);
  using PcieFn = nvmlReturn_t (*)(nvmlDevice_t, int, unsigned int*);
  // Opened once for the life of the process: monitoring reads every few seconds.
  static const Library lib("libnvidia-ml.so.1");
  static const bool started = [] {
    auto init = lib ? lib.symbol<InitFn>({"nvmlInit_v2", "nvmlInit"}) : nullptr;
    return init && init() == NVML_SUCCESS;
  }();
  if (!started) {
    why = "NVML (libnvidia-ml.so.1) is not available or did not start";
    return std::nullopt;
  }
  auto get_handle = lib.symbol<GetHandleFn>({"nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"});
  nvmlDevice_t device = nullptr;
  if (!get_handle || get_handle(index, &device) != NVML_SUCCESS) {
    why = "NVML has no device " + std::to_string(index);
    return std::nullopt;
  }
  GpuGauges g;
  if (auto f = lib.symbol<UtilizationFn>({"nvmlDeviceGetUtilizationRates"})) {
    Utilization u{};
    if (f(device, &u) == NVML_SUCCESS) g.utilization_percent = u.gpu;
  }
  if (auto f = lib.symbol<MemoryFn>({"nvmlDeviceGetMemoryInfo"})) {
    Memory m{};
    if (f(device, &m) == NVML_SUCCESS) g.memory_used_bytes = double(m.used), g.memory_total_bytes = double(m.total);
  }
  if (auto f = lib.symbol<TemperatureFn>({"nvmlDeviceGetTemperature"})) {
    unsigned int t = 0;
    if (f(device, /*NVML_TEMPERATURE_GPU=*/0, &t) == NVML_SUCCESS) g.temperature_celsius = t;
  }
  if (auto f = lib.symbol<PcieFn>({"nvmlDeviceGetPcieThroughput"})) {
    unsigned int kb = 0;  // KB/s
    if (f(device, /*NVML_PCIE_UTIL_TX_BYTES=*/0, &kb) == NVML_SUCCESS) g.pcie_tx_bytes_per_second = 1024.0 * kb;
    if (f(device, /*NVML_PCIE_UTIL_RX_BYTES=*/1, &kb) == NVML_SUCCESS) g.pcie_rx_bytes_per_second = 1024.0 * kb;
  }
  return g;
}

}  // namespace loom::topo

namespace loom::topo::detail {

std::optional<Link> link_from_nvml_level(int level) {
  switch (level) {
    case 0:   // NVML_TOPOLOGY_INTERNAL: devices on one board
    case 10:  // NVML_TOPOLOGY_SINGLE
      return Link{LinkClass::PIX, 0};
    case 20:
      return Link{LinkClass::PXB, 0};  // NVML_TOPOLOGY_MULTIPLE
    case 30:
      return Link{LinkClass::PHB, 0};  // NVML_TOPOLOGY_HOSTBRIDGE
    case 40:
      return Link{LinkClass::NODE, 0};  // NVML_TOPOLOGY_NODE
    case 50:
      return Link{LinkClass::SYS, 0};  // NVML_TOPOLOGY_SYSTEM
    default:
      return std::nullopt;
  }
}

namespace {

// The NVML entry points read_nvml calls; the optional ones (name, affinity, NVLink, common
// ancestor) may be null, and what they would say is then left out.
struct NvmlApi {
  InitFn init = nullptr;
  ShutdownFn shutdown = nullptr;
  ErrorStringFn error_string = nullptr;
  GetCountFn get_count = nullptr;
  GetHandleFn get_handle = nullptr;
  GetNameFn get_name = nullptr;
  GetPciInfoFn get_pci = nullptr;
  GetNvLinkStateFn nvlink_state = nullptr;
  GetNvLinkRemotePciFn nvlink_remote = nullptr;
  GetCpuAffinityFn cpu_affinity = nullptr;
  GetCommonAncestorFn common_ancestor = nullptr;

  explicit NvmlApi(const Library& lib)
      : init(lib.symbol<InitFn>({"nvmlInit_v2", "nvmlInit"})),
        shutdown(lib.symbol<ShutdownFn>({"nvmlShutdown"})),
        error_string(lib.symbol<ErrorStringFn>({"nvmlErrorString"})),
        get_count(lib.symbol<GetCountFn>({"nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"})),
        get_handle(lib.symbol<GetHandleFn>({"nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"})),
        get_name(lib.symbol<GetNameFn>({"nvmlDeviceGetName"})),
        get_pci(lib.symbol<GetPciInfoFn>({"nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2"})),
        nvlink_state(lib.symbol<GetNvLinkStateFn>({"nvmlDeviceGetNvLinkState"})),
        nvlink_remote(lib.symbol<GetNvLinkRemotePciFn>({"nvmlDeviceGetNvLinkRemotePciInfo_v2"})),
        cpu_affinity(lib.symbol<GetCpuAffinityFn>({"nvmlDeviceGetCpuAffinity"})),
        common_ancestor(lib.symbol<GetCommonAncestorFn>({"nvmlDeviceGetTopologyCommonAncestor"})) {}

  bool complete() const { return init && shutdown && get_count && get_handle && get_pci; }

  std::string describe(nvmlReturn_t r) const {
    std::string s = "NVML error " + std::to_string(r);
    if (error_string) {
      const char* text = error_string(r);
      if (text) s += " (" + std::string(text) + ")";
    }
    return s;
  }
};

// The CPUs NVML reports close to the device; empty (and a note) when the call fails.
std::vector<int> affinity_cpus(const NvmlApi& api, nvmlDevice_t handle, unsigned index,
                               const std::function<void(const std::string&)>& note) {
  constexpr unsigned kBits = sizeof(unsigned long) * CHAR_BIT;
  constexpr unsigned kWords = (kMaxCpu + 1) / kBits;
  std::vector<unsigned long> mask(kWords, 0);
  std::vector<int> cpus;
  if (nvmlReturn_t r = api.cpu_affinity(handle, kWords, mask.data()); r != NVML_SUCCESS) {
    note("nvmlDeviceGetCpuAffinity(" + std::to_string(index) + "): " + api.describe(r));
    return cpus;
  }
  for (unsigned w = 0; w < kWords; ++w)
    for (unsigned b = 0; b < kBits; ++b)
      if (mask[w] & (1ul << b)) cpus.push_back(static_cast<int>(w * kBits + b));
  return cpus;
}

// Device `index`: its PCI bus id, name, CPUs and active NVLinks (by the remote end's bus id).
// nullopt and `why` when a call every device must answer fails.
std::optional<NvmlDevice> read_device(const NvmlApi& api, unsigned index, nvmlDevice_t& handle, std::string& why,
                                      const std::function<void(const std::string&)>& note) {
  NvmlDevice dev;
  if (nvmlReturn_t r = api.get_handle(index, &handle); r != NVML_SUCCESS) {
    why = "nvmlDeviceGetHandleByIndex(" + std::to_string(index) + ") failed: " + api.describe(r);
    return std::nullopt;
  }
  nvmlPciInfo_t pci{};
  if (nvmlReturn_t r = api.get_pci(handle, &pci); r != NVML_SUCCESS) {
    why = "nvmlDeviceGetPciInfo(" + std::to_string(index) + ") failed: " + api.describe(r);
    return std::nullopt;
  }
  dev.bus_id = bus_id_of(pci);
  if (api.get_name) {
    char name[96] = {};
    if (api.get_name(handle, name, sizeof(name) - 1) == NVML_SUCCESS) dev.name = name;
  }
  if (api.cpu_affinity) dev.cpus = affinity_cpus(api, handle, index, note);
  if (api.nvlink_state && api.nvlink_remote) {
    for (unsigned link = 0; link < NVML_NVLINK_MAX_LINKS; ++link) {
      int active = 0;
      if (api.nvlink_state(handle, link, &active) != NVML_SUCCESS || active != NVML_FEATURE_ENABLED) continue;
      nvmlPciInfo_t remote{};
      if (api.nvlink_remote(handle, link, &remote) != NVML_SUCCESS) continue;
      ++dev.nvlinks[bus_id_of(remote)];
    }
  }
  return dev;
}

}  // namespace

std::optional<NvmlSnapshot> read_nvml(const std::string& library, std::string& why) {
  Library lib(library);
  if (!lib) {
    const char* err = dlerror();
    why = "cannot load " + library + ": " + (err ? err : "unknown dlopen error");
    return std::nullopt;
  }
  const NvmlApi api(lib);
  if (!api.complete()) {
    why = library + " lacks nvmlInit/nvmlShutdown/nvmlDeviceGetCount/nvmlDeviceGetHandleByIndex/nvmlDeviceGetPciInfo";
    return std::nullopt;
  }
  if (nvmlReturn_t r = api.init(); r != NVML_SUCCESS) {
    why = "nvmlInit failed: " + api.describe(r);
    return std::nullopt;
  }
  NvmlSnapshot snap;
  unsigned count = 0;
  if (nvmlReturn_t r = api.get_count(&count); r != NVML_SUCCESS) {
    why = "nvmlDeviceGetCount failed: " + api.describe(r);
    api.shutdown();
    return std::nullopt;
  }
  auto note = [&](const std::string& s) {
    if (snap.driver_notes.size() < 2000) snap.driver_notes += (snap.driver_notes.empty() ? "" : "; ") + s;
  };
  std::vector<nvmlDevice_t> handles(count, nullptr);
  for (unsigned i = 0; i < count; ++i) {
    auto dev = read_device(api, i, handles[i], why, note);
    if (!dev) {
      api.shutdown();
      return std::nullopt;
    }
    snap.devices.push_back(std::move(*dev));
  }
  snap.common_ancestor.assign(count, std::vector<int>(count, -1));
  if (api.common_ancestor) {
    for (unsigned a = 0; a < count; ++a)
      for (unsigned b = a + 1; b < count; ++b) {
        int level = -1;
        if (api.common_ancestor(handles[a], handles[b], &level) == NVML_SUCCESS)
          snap.common_ancestor[a][b] = snap.common_ancestor[b][a] = level;
      }
  }
  api.shutdown();
  return snap;
}

}  // namespace loom::topo::detail
