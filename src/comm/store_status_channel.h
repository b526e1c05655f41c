// The side channel's transport for jobs without MPI (comm/side_channel.h runs the protocol), over
// the rendezvous key-value store (c10d::Store): what the Gloo backend installs.
//
// A question or a notice is a key in the store and one increment of a shared event counter; each
// rank's watchdog reads that counter every poll (one small request) and looks for new keys only
// when it moved. A rank that asks or leaves polls for the answers or acknowledgements until its
// deadline. The channel's store connection is its own, with a short timeout, so a store that
// stops answering (its server stopped) delays a watchdog poll by at most that timeout.
//
// Keys, under the prefix given to start():
//   events             counter: every notice and question adds one
//   left/<r>           rank r's departure: "<status>\n<key>:<collective>:<internal> ...\n<reason>";
//                      left/<r>/acks counts readers
//   q/next, q/<id>     question ids, and question id: "<key> <internal> <seq>"
//   a/<id>/<r>         rank r's answer to question id
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace loom::detail::store_status {

// Installs the transport and announcer for job rank `rank` of `size` over `store` (which should be
// a connection of the channel's own). Idempotent.
void start(c10::intrusive_ptr<c10d::Store> store, int rank, int size);
// Removes them (before the store goes away).
void stop();

}  // namespace loom::detail::store_status
