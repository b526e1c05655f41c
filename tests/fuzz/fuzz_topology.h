// Shared by the topology fuzz targets: what an accepted topology must satisfy. A parser either
// throws loom::topo::ParseError (any other exception escapes and libFuzzer reports it as a crash)
// or returns a model that validates and survives a JSON round trip unchanged in shape.
#pragma once

#include <cstdlib>

#include "loom/topology/topology.h"

namespace loom::fuzz {

inline void check_accepted(const topo::Topology& t) {
  topo::validate(t);  // throws std::invalid_argument: a parser let an inconsistent model through
  const topo::Topology again = topo::topology_from_json(topo::to_json(t), "round trip");
  if (again.nodes.size() != t.nodes.size()) std::abort();
  for (size_t i = 0; i < t.nodes.size(); ++i)
    if (again.nodes[i].gpus.size() != t.nodes[i].gpus.size() || again.nodes[i].nics.size() != t.nodes[i].nics.size() ||
        !(again.nodes[i].gpu_links == t.nodes[i].gpu_links))
      std::abort();
}

}  // namespace loom::fuzz
