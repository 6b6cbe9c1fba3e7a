#pragma once
// The whole public API of halfgrad in one include.
#include "core/autograd.h"
#include "core/log.h"
#include "core/tensor.h"
#include "ops/copy.h"
#include "ops/elementwise.h"
#include "ops/loss.h"
#include "ops/matmul.h"
#include "ops/reduce.h"
#include "ops/shape.h"
#include "optim/sgd.h"
