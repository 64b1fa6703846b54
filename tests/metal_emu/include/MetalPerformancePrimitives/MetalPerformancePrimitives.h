// Emulator stand-in for the Metal header of this name.
#include "metal_emu.h"
