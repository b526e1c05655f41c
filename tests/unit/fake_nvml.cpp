// A stand-in for libnvidia-ml.so.1, loaded by detect_host() through the same dlopen path as the
// real one. It describes a 4-GPU machine (tests/fixtures/hwloc/two_socket_4gpu.xml has the same
// PCI bus ids):
//   GPU0 0000:07:00.0, GPU1 0000:08:00.0  (socket 0, CPUs 0-3), NVLink x4 to each other
//   GPU2 0000:87:00.0, GPU3 0000:88:00.0  (socket 1, CPUs 4-7), NVLink x2 to each other
//   GPU0, GPU1, GPU2 also have 2 links each to an NVSwitch (0000:f0:00.0); GPU3 has none.
// FAKE_NVML_FAIL_INIT=1 makes nvmlInit fail as without a driver; FAKE_NVML_COUNT=n reports n GPUs.
#include <cstdio>
#include <cstdlib>
#include <cstring>

extern "C" {

struct nvmlDevice_st {
  int index;
};
struct nvmlPciInfo_t {
  char busIdLegacy[16];
  unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
};

static nvmlDevice_st devices[4] = {{0}, {1}, {2}, {3}};
static const char* bus_ids[4] = {"00000000:07:00.0", "00000000:08:00.0", "00000000:87:00.0", "00000000:88:00.0"};
static const char* kSwitch = "00000000:F0:00.0";

// Per GPU, the remote end of each active link (nullptr: link down).
static const char* remote(int gpu, unsigned link) {
  static const char* table[4][6] = {
      {"00000000:08:00.0", "00000000:08:00.0", "00000000:08:00.0", "00000000:08:00.0", kSwitch, kSwitch},
      {"00000000:07:00.0", "00000000:07:00.0", "00000000:07:00.0", "00000000:07:00.0", kSwitch, kSwitch},
      {"00000000:88:00.0", "00000000:88:00.0", kSwitch, kSwitch, nullptr, nullptr},
      {"00000000:87:00.0", "00000000:87:00.0", nullptr, nullptr, nullptr, nullptr}};
  return link < 6 ? table[gpu][link] : nullptr;
}

int nvmlInit_v2() {
  const char* fail = std::getenv("FAKE_NVML_FAIL_INIT");
  return fail && std::strcmp(fail, "1") == 0 ? 9 : 0;  // 9: NVML_ERROR_DRIVER_NOT_LOADED
}
int nvmlShutdown() {
  return 0;
}
const char* nvmlErrorString(int r) {
  return r == 9 ? "Driver Not Loaded" : r == 0 ? "Success" : "Unknown Error";
}
int nvmlDeviceGetCount_v2(unsigned int* count) {
  const char* n = std::getenv("FAKE_NVML_COUNT");
  *count = n ? static_cast<unsigned>(std::atoi(n)) : 4;
  if (*count > 4) *count = 4;
  return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_st** d) {
  if (i >= 4) return 2;
  *d = &devices[i];
  return 0;
}
int nvmlDeviceGetName(nvmlDevice_st* d, char* name, unsigned int length) {
  std::snprintf(name, length, "Fake GPU %d", d->index);
  return 0;
}
static void fill(nvmlPciInfo_t* pci, const char* bus) {
  std::memset(pci, 0, sizeof(*pci));
  std::snprintf(pci->busId, sizeof(pci->busId), "%s", bus);
  std::snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%s", bus + 4);
}
int nvmlDeviceGetPciInfo_v3(nvmlDevice_st* d, nvmlPciInfo_t* pci) {
  fill(pci, bus_ids[d->index]);
  return 0;
}
int nvmlDeviceGetNvLinkState(nvmlDevice_st* d, unsigned int link, int* active) {
  if (link >= 18) return 2;  // NVML_ERROR_INVALID_ARGUMENT
  *active = remote(d->index, link) ? 1 : 0;
  return 0;
}
int nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_st* d, unsigned int link, nvmlPciInfo_t* pci) {
  const char* r = remote(d->index, link);
  if (!r) return 3;  // NVML_ERROR_NOT_SUPPORTED
  fill(pci, r);
  return 0;
}
int nvmlDeviceGetCpuAffinity(nvmlDevice_st* d, unsigned int words, unsigned long* set) {
  if (words < 1) return 2;
  std::memset(set, 0, words * sizeof(unsigned long));
  set[0] = d->index < 2 ? 0x0ful : 0xf0ul;
  return 0;
}
int nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_st* a, nvmlDevice_st* b, int* level) {
  bool same_socket = (a->index < 2) == (b->index < 2);
  *level = same_socket ? 10 : 50;  // NVML_TOPOLOGY_SINGLE / NVML_TOPOLOGY_SYSTEM
  return 0;
}

}  // extern "C"
