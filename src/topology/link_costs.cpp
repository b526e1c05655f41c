#include <limits>

#include "loom/topology/topology.h"

namespace loom::topo {

LinkCost LinkCosts::cost(Link link) const {
  switch (link.cls) {
    case LinkClass::Self:
      return {std::numeric_limits<double>::infinity(), 0.0};
    case LinkClass::NV:
      return {nv_per_link.bandwidth_gbps * link.nvlinks, nv_per_link.latency_us};
    case LinkClass::PIX:
      return pix;
    case LinkClass::PXB:
      return pxb;
    case LinkClass::PHB:
      return phb;
    case LinkClass::NODE:
      return node;
    case LinkClass::SYS:
      return sys;
    case LinkClass::NET:
      return net;
  }
  return sys;
}

}  // namespace loom::topo
