// Every installed header in one translation unit, compiled with the
// warnings a strict consumer turns into errors (tests/CMakeLists.txt):
// <gpipe/dist.h> declared gather_trace twice, which -Wredundant-decls
// refuses. tests/source_rules_test.sh checks that every header is here.
#include <gpipe/autotune.h>
#include <gpipe/balance.h>
#include <gpipe/batchnorm.h>
#include <gpipe/checkpoint.h>
#include <gpipe/checkpoint_io.h>
#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gpipe/microbatch.h>
#include <gpipe/models/amoebanet.h>
#include <gpipe/models/resnet.h>
#include <gpipe/models/timed.h>
#include <gpipe/models/unet.h>
#include <gpipe/module.h>
#include <gpipe/options.h>
#include <gpipe/placement.h>
#include <gpipe/plan.h>
#include <gpipe/schedule.h>
#include <gpipe/serialize.h>
#include <gpipe/skip.h>
#include <gpipe/trace.h>
#include <gpipe/verify.h>
