// The pretend H100's device attributes, by number (the runtime's cudaDeviceAttr and the driver's
// CUdevice_attribute share them); 0 for the rest.
static int h100_attribute(int a){
  switch(a){
    case 1: case 2: case 3: return 1024;            // threads per block, block dims x, y
    case 4: return 64;                              // block dim z
    case 5: return 2147483647; case 6: case 7: return 65535;  // grid dims
    case 8: return 49152;                           // shared memory per block
    case 9: return 65536;                           // constant memory
    case 10: return 32;                             // warp size
    case 12: return 65536;                          // registers per block
    case 13: return 1980000;                        // clock, kHz
    case 16: return 132;                            // SMs
    case 36: return 2619000; case 37: return 5120; case 38: return 50<<20;  // memory clock, bus, L2
    case 39: return 2048;                           // threads per SM
    case 75: return 9; case 76: return 0;           // compute capability
    case 81: return 233472; case 82: return 65536;  // shared memory, registers per SM
    case 97: return 232448;                         // opt-in shared memory per block
    case 106: return 32;                            // blocks per SM
    default: return 0;}}
