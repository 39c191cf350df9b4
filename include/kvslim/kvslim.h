// kvslim: bounds and compresses the key/value cache of LLM inference. Umbrella header.
#pragma once
#include "kvslim/block.h"
#include "kvslim/cache.h"
#include "kvslim/config.h"
#include "kvslim/convert.h"
#include "kvslim/dtype.h"
#include "kvslim/errors.h"
#include "kvslim/factory.h"
#include "kvslim/methods.h"
#include "kvslim/prior_scores.h"
#include "kvslim/squeeze.h"
#if __has_include("kvslim/zipcache.h")
#include "kvslim/zipcache.h"
#endif
