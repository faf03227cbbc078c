#pragma once

// gpipe: GPipe pipeline parallelism for LibTorch. Umbrella header.

#include <gpipe/autotune.h>
#include <gpipe/balance.h>
#include <gpipe/batchnorm.h>
#include <gpipe/checkpoint.h>
#include <gpipe/checkpoint_io.h>
#include <gpipe/microbatch.h>
#include <gpipe/module.h>
#include <gpipe/options.h>
#include <gpipe/placement.h>
#include <gpipe/plan.h>
#include <gpipe/schedule.h>
#include <gpipe/serialize.h>
#include <gpipe/skip.h>
#include <gpipe/trace.h>
#include <gpipe/verify.h>
