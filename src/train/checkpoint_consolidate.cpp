// consolidate_checkpoint: a checkpoint's full tensors as one safetensors file, through the same
// planner and reader as a load at world size 1 (so every shard is verified whole).
#include <unistd.h>

#include <set>

#include "loom/error.h"
#include "loom/train/checkpoint.h"
#include "train/checkpoint_files.h"
#include "train/checkpoint_io.h"
#include "train/checkpoint_load_plan.h"
#include "train/checkpoint_read.h"
#include "train/checkpoint_storage.h"
#include "train/safetensors.h"

namespace loom {

using namespace detail::ckpt;

ConsolidateInfo consolidate_checkpoint(const std::string& checkpoint, const std::string& out,
                                       const ConsolidateOptions& options) {
  const std::string where = "consolidate " + checkpoint;
  const auto storage = checkpoint::open_storage(parent_of(checkpoint), /*keep_last=*/0, where);
  const std::string manifest_path = checkpoint + "/" + kManifestName;
  const std::string text = read_manifest_text(*storage, checkpoint, where);
  check_manifest_integrity(text, where + ": manifest " + manifest_path);
  const Manifest manifest = parse_manifest(text, where + ": manifest " + manifest_path);

  // Every wanted tensor whole; output names checked for collisions before anything is read.
  std::vector<Need> needs;
  std::map<std::string, std::string> output_names;  // output name -> saved name
  for (const auto& [name, record] : manifest.tensors) {
    // C++ models save model/<name>, optim/<param>/<key> and ZeRO's fp32 master/<param>; Python's
    // Checkpointer saves them all (and objects' tensors) under extra/. Masters are optimizer state.
    std::string output = name;
    if (name.rfind("model/", 0) == 0 || name.rfind("extra/", 0) == 0) output = name.substr(6);
    else if (name.rfind("optim/", 0) != 0 && name.rfind("master/", 0) != 0) continue;  // RNG states
    if (output.rfind("objects/", 0) == 0) continue;
    const bool optimizer_state = output.rfind("optim/", 0) == 0 || output.rfind("master/", 0) == 0;
    if (optimizer_state && !options.optimizer) continue;
    auto [it, inserted] = output_names.emplace(output, name);
    if (!inserted)
      throw CheckpointError(where + ": both " + it->second + " and " + name + " would be named \"" + output + "\"");
    needs.push_back({name, &record, slice_box(record.shape, -1, 0, 0), record.shape});
  }
  const LoadPlan plan = plan_load(manifest, needs, /*rank=*/0, /*size=*/1);
  uint64_t bytes_read = 0;
  const LoadedTensors full = read_planned(*storage, checkpoint, manifest, needs, plan, bytes_read, where);

  std::vector<TensorSpec> specs;
  ShardWrite write;
  ConsolidateInfo info;
  for (const auto& [output, saved] : output_names) {  // sorted by output name
    const at::Tensor& t = full.at(saved);
    specs.push_back({output, t.scalar_type(), t.sizes().vec()});
    const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    write.regions.push_back({t.data_ptr(), bytes});
    info.bytes += bytes;
    ++info.tensors;
  }
  write.header = build_header(specs, {{"format", "pt"}, {"torchloom.step", std::to_string(manifest.step)}});
  write.path = out + ".tmp-" + std::to_string(::getpid());
  try {
    write_shard(*create_file(write.path, where), write, where);
    rename_path(write.path, out, where);
  } catch (...) {
    remove_tree(write.path);
    throw;
  }
  return info;
}

}  // namespace loom
