// The header the emulated shaders see (through include/metal_stdlib, include/metal_tensor and
// include/MetalPerformancePrimitives/MetalPerformancePrimitives.h): the emulator's types and
// functions, then Metal's address-space qualifiers and function keyword as empty macros. No
// C++ standard header may be included after this one.
#pragma once
#include "metal_emu_core.h"

#define device
#define threadgroup
#define constant
#define thread
#define kernel
