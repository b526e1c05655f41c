// torchloom: distributed training for LibTorch programs. Include this for the whole public API.
#pragma once

#include "loom/amp/autocast.h"
#include "loom/amp/grad_scaler.h"
#include "loom/comm/communicator.h"
#include "loom/comm/groups.h"
#include "loom/comm/mpi.h"
#include "loom/comm/nccl.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/parallel/zero.h"
#include "loom/train/accumulation.h"
#include "loom/train/checkpoint.h"
#include "loom/runtime.h"
#include "loom/world.h"
