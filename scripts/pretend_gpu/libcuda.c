// libcuda.so.1 for a machine with no GPU: the driver calls torch and Triton make, answered for one
// pretend H100 (sm_90). Modules load as handles to nothing and launches do nothing. See README.md.
#include <string.h>
#include <stdlib.h>
#include "h100.h"
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static int fake_ctx, fake_mod, fake_fn;
// Launches (Triton's kernels) are counted: pretend_gpu.py reads the count beside the runtime's.
static unsigned long long n_launches;
unsigned long long pretend_gpu_driver_ops(void){return __atomic_load_n(&n_launches, __ATOMIC_RELAXED);}
static CUresult launch(void){__atomic_add_fetch(&n_launches, 1, __ATOMIC_RELAXED); return 0;}
CUresult cuInit(unsigned f){return 0;}
CUresult cuDriverGetVersion(int* v){*v=13000;return 0;}
CUresult cuDeviceGet(int* d, int o){*d=0;return 0;}
CUresult cuDeviceGetCount(int* c){*c=1;return 0;}
CUresult cuDeviceGetName(char* s, int n, int d){strncpy(s,"NVIDIA H100 80GB HBM3 (pretend)",n);return 0;}
CUresult cuDeviceTotalMem(size_t* b, int d){*b=80ull<<30;return 0;}
CUresult cuDeviceTotalMem_v2(size_t* b, int d){*b=80ull<<30;return 0;}
CUresult cuDeviceGetAttribute(int* v, int a, int d){*v=h100_attribute(a);return 0;}
CUresult cuDevicePrimaryCtxGetState(int dev, unsigned* flags, int* active){*flags=0;*active=1;return 0;}
CUresult cuDevicePrimaryCtxRetain(void** c, int d){*c=&fake_ctx;return 0;}
CUresult cuCtxGetCurrent(void** c){*c=&fake_ctx;return 0;}
CUresult cuCtxSetCurrent(void* c){return 0;}
CUresult cuCtxGetDevice(int* d){*d=0;return 0;}
CUresult cuCtxSynchronize(void){return 0;}
CUresult cuCtxGetLimit(size_t* v, int l){*v=1024;return 0;}
CUresult cuCtxSetLimit(int l, size_t v){return 0;}
CUresult cuModuleLoadData(void** m, const void* img){*m=&fake_mod;return 0;}
CUresult cuModuleLoadDataEx(void** m, const void* img, unsigned n, void* o, void** ov){*m=&fake_mod;return 0;}
CUresult cuModuleUnload(void* m){return 0;}
CUresult cuModuleGetFunction(void** f, void* m, const char* name){*f=&fake_fn;return 0;}
CUresult cuModuleGetGlobal(CUdeviceptr* p, size_t* n, void* m, const char* name){static char g[4096]; if(p)*p=(CUdeviceptr)g; if(n)*n=sizeof g; return 0;}
CUresult cuModuleGetGlobal_v2(CUdeviceptr* p, size_t* n, void* m, const char* name){return cuModuleGetGlobal(p,n,m,name);}
CUresult cuFuncGetAttribute(int* v, int a, void* f){
  switch(a){case 0: *v=1024; break; case 4: *v=32; break; default: *v=0;} return 0;}
CUresult cuFuncSetAttribute(void* f, int a, int v){return 0;}
CUresult cuFuncSetCacheConfig(void* f, int c){return 0;}
CUresult cuOccupancyMaxActiveClusters(int* n, void* f, const void* cfg){*n=1;return 0;}
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void* f, int b, size_t s){*n=1;return 0;}
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shm, void* stream, void** params, void** extra){return launch();}
CUresult cuLaunchKernel_ptsz(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shm, void* stream, void** params, void** extra){return launch();}
CUresult cuLaunchKernelEx(const void* cfg, void* f, void** params, void** extra){return launch();}
CUresult cuLaunchCooperativeKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shm, void* stream, void** params){return launch();}
CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p){
  if(attr==3){*(CUdeviceptr*)data=p;} else if(attr==2){*(int*)data=2;} else {*(int*)data=0;} return 0;}
CUresult cuPointerGetAttributes(unsigned n, int* attrs, void** data, CUdeviceptr p){
  for(unsigned i=0;i<n;i++) cuPointerGetAttribute(data[i],attrs[i],p); return 0;}
CUresult cuMemGetAddressRange(CUdeviceptr* b, size_t* s, CUdeviceptr p){if(b)*b=p; if(s)*s=0; return 0;}
CUresult cuMemGetAddressRange_v2(CUdeviceptr* b, size_t* s, CUdeviceptr p){return cuMemGetAddressRange(b,s,p);}
CUresult cuTensorMapEncodeTiled(void* m, ...){return 0;}
CUresult cuTensorMapEncodeIm2col(void* m, ...){return 0;}
CUresult cuStreamGetCtx(void* s, void** c){*c=&fake_ctx;return 0;}
CUresult cuGetErrorString(CUresult e, const char** s){*s="a CUDA driver call the pretend GPU does not answer (add it to scripts/pretend_gpu/libcuda.c)";return 0;}
CUresult cuGetErrorName(CUresult e, const char** s){*s="CUDA_ERROR_PRETEND";return 0;}
CUresult cuModuleLoad(void** m, const char* path){*m=&fake_mod;return 0;}
CUresult cuModuleLoadFatBinary(void** m, const void* img){*m=&fake_mod;return 0;}
CUresult cuLibraryLoadData(void** l, const void* c, void* a, void* b, unsigned n, void* d, void* e, unsigned m){*l=&fake_mod;return 0;}
CUresult cuLibraryGetKernel(void** k, void* l, const char* n){*k=&fake_fn;return 0;}
CUresult cuLibraryUnload(void* l){return 0;}
CUresult cuOccupancyMaxPotentialBlockSize(int* g, int* b, void* f, void* cb, size_t s, int l){*g=132;*b=1024;return 0;}
CUresult cuFuncGetName(const char** n, void* f){*n="pretend";return 0;}
CUresult cuStreamSynchronize(void* s){return 0;}
CUresult cuMemAlloc(CUdeviceptr* p, size_t n){*p=(CUdeviceptr)malloc(n?n:1);return 0;}
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n){return cuMemAlloc(p,n);}
CUresult cuMemFree(CUdeviceptr p){return 0;}
CUresult cuMemFree_v2(CUdeviceptr p){return 0;}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void* s){return 0;}
CUresult cuMemsetD32Async(CUdeviceptr p, unsigned v, size_t n, void* s){return 0;}
CUresult cuMemcpyDtoH(void* d, CUdeviceptr s, size_t n){return 0;}
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n){return 0;}
CUresult cuMemcpyHtoD(CUdeviceptr d, const void* s, size_t n){return 0;}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n){return 0;}
