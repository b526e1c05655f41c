// Start-up agreements: every rank checks the same things and all of them raise together, so that
// no rank is left waiting in a collective for a rank that gave up.
#pragma once

#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/world.h"

namespace loom::detail {

// Every LOOM_* variable must have the same value on every rank (but those set per process,
// LOOM_DEVICE). Throws loom::ConfigError on every
// rank naming each variable that differs and which ranks hold which value.
void agree_on_configuration(Communicator& world, const Environment& env);

// Every rank contributes its own problem ("" when none); when any rank has one, every rank throws
// loom::ConfigError naming the ranks (and this rank's problem, when it has one).
void agree_all_ok(Communicator& world, const std::string& my_problem, const std::string& what);

}  // namespace loom::detail
