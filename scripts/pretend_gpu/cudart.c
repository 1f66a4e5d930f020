// The CUDA runtime calls torch's CUDA build makes, answered for one pretend H100 (sm_90) on a machine
// with no GPU (LD_PRELOADed by ./run). Device memory is address space nobody writes, kernels launch
// into nothing, host<->device copies are real. See README.md.
#include <cuda_runtime_api.h>
#include <string.h>
#include <stdlib.h>
#include <stdio.h>
#include <sys/mman.h>
#include <pthread.h>
#include "h100.h"
cudaError_t cudaGetDeviceCount(int* c){*c=1;return cudaSuccess;}
cudaError_t cudaGetDevice(int* d){*d=0;return cudaSuccess;}
cudaError_t cudaSetDevice(int d){return cudaSuccess;}
cudaError_t cudaGetLastError(void){return cudaSuccess;}
cudaError_t cudaPeekAtLastError(void){return cudaSuccess;}
cudaError_t cudaDeviceGetStreamPriorityRange(int* lo,int* hi){*lo=0;*hi=-5;return cudaSuccess;}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned f, int p){static long k=16; *s=(cudaStream_t)(k++); return cudaSuccess;}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned f){*e=(cudaEvent_t)malloc(64);return cudaSuccess;}
cudaError_t cudaEventCreate(cudaEvent_t* e){*e=(cudaEvent_t)malloc(64);return cudaSuccess;}
cudaError_t cudaEventDestroy(cudaEvent_t e){return cudaSuccess;}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s){return cudaSuccess;}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned f){return cudaSuccess;}
cudaError_t cudaEventQuery(cudaEvent_t e){return cudaSuccess;}
cudaError_t cudaEventSynchronize(cudaEvent_t e){return cudaSuccess;}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f){return cudaSuccess;}
cudaError_t cudaStreamQuery(cudaStream_t s){return cudaSuccess;}
cudaError_t cudaStreamSynchronize(cudaStream_t s){return cudaSuccess;}
cudaError_t cudaDeviceSynchronize(void){return cudaSuccess;}
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode* m){return cudaSuccess;}
cudaError_t cudaDriverGetVersion(int* v){*v=13000;return cudaSuccess;}
cudaError_t cudaRuntimeGetVersion(int* v){*v=13000;return cudaSuccess;}
cudaError_t cudaMemGetInfo(size_t* f, size_t* t){*t=80ull<<30;*f=*t;return cudaSuccess;}
cudaError_t cudaDeviceCanAccessPeer(int* c, int a, int b){*c=0;return cudaSuccess;}
cudaError_t cudaDeviceGetPCIBusId(char* s, int n, int d){snprintf(s,n,"0000:00:00.0");return cudaSuccess;}
const char* cudaGetErrorString(cudaError_t e){return "a CUDA runtime call the pretend GPU does not answer (add it to scripts/pretend_gpu/cudart.c)";}
const char* cudaGetErrorName(cudaError_t e){return "cudaErrorPretendGpu";}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* p, int d){
  memset(p,0,sizeof(*p));
  strcpy(p->name,"NVIDIA H100 80GB HBM3 (pretend)");
  p->major=9; p->minor=0; p->multiProcessorCount=132; p->totalGlobalMem=80ull<<30;
  p->sharedMemPerBlock=49152; p->sharedMemPerBlockOptin=232448; p->sharedMemPerMultiprocessor=233472;
  p->regsPerBlock=65536; p->regsPerMultiprocessor=65536; p->warpSize=32; p->maxThreadsPerBlock=1024;
  p->maxThreadsPerMultiProcessor=2048; p->maxThreadsDim[0]=1024; p->maxThreadsDim[1]=1024; p->maxThreadsDim[2]=64;
  p->maxGridSize[0]=2147483647; p->maxGridSize[1]=65535; p->maxGridSize[2]=65535; p->l2CacheSize=50<<20;
  p->memoryBusWidth=5120; p->totalConstMem=65536; p->integrated=0; p->concurrentKernels=1;
  p->asyncEngineCount=3; p->unifiedAddressing=1; p->managedMemory=1; p->pciBusID=0;
  return cudaSuccess;}
cudaError_t cudaDeviceGetAttribute(int* v, enum cudaDeviceAttr a, int d){*v=h100_attribute((int)a);return cudaSuccess;}
// Device memory: address space only (MAP_NORESERVE), never touched by a kernel, so a model's whole
// activation set can be "allocated" on a CPU machine while the caching allocator counts it.
#define MAXA 65536
static void* aptr[MAXA]; static size_t asz[MAXA]; static pthread_mutex_t amu = PTHREAD_MUTEX_INITIALIZER;
cudaError_t cudaMalloc(void** p, size_t n){
  if(n==0) n=512;
  void* q = mmap(NULL, n, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE, -1, 0);
  if(q==MAP_FAILED){*p=0; return cudaErrorMemoryAllocation;}
  pthread_mutex_lock(&amu);
  for(int i=0;i<MAXA;i++) if(!aptr[i]){aptr[i]=q; asz[i]=n; break;}
  pthread_mutex_unlock(&amu);
  *p=q; return cudaSuccess;}
cudaError_t cudaFree(void* p){
  if(!p) return cudaSuccess;
  pthread_mutex_lock(&amu);
  for(int i=0;i<MAXA;i++) if(aptr[i]==p){munmap(p, asz[i]); aptr[i]=0; break;}
  pthread_mutex_unlock(&amu);
  return cudaSuccess;}
cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t s){return cudaMalloc(p,n);}
cudaError_t cudaFreeAsync(void* p, cudaStream_t s){return cudaFree(p);}
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned f){*p=malloc(n?n:1);return cudaSuccess;}
cudaError_t cudaMallocHost(void** p, size_t n){*p=malloc(n?n:1);return cudaSuccess;}
cudaError_t cudaFreeHost(void* p){free(p);return cudaSuccess;}
cudaError_t cudaHostRegister(void* p, size_t n, unsigned f){return cudaSuccess;}
cudaError_t cudaHostUnregister(void* p){return cudaSuccess;}
cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned f){*d=h;return cudaSuccess;}
// Host<->device copies are real (inputs and .item() read back what was put in); device-to-device
// copies do nothing, as kernels do.
static cudaError_t op(void);
static cudaError_t copy(void* d, const void* s, size_t n, enum cudaMemcpyKind k){
  if(k!=cudaMemcpyDeviceToDevice) memcpy(d,s,n); return op();}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, enum cudaMemcpyKind k, cudaStream_t st){return copy(d,s,n,k);}
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, enum cudaMemcpyKind k){return copy(d,s,n,k);}
cudaError_t cudaMemcpy2DAsync(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, enum cudaMemcpyKind k, cudaStream_t st){return cudaSuccess;}
cudaError_t cudaMemcpyPeerAsync(void* d, int dd, const void* s, int sd, size_t n, cudaStream_t st){return cudaSuccess;}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s){return op();}
cudaError_t cudaMemset(void* p, int v, size_t n){return op();}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* a, const void* p){memset(a,0,sizeof(*a));a->type=cudaMemoryTypeDevice;a->devicePointer=(void*)p;a->hostPointer=(void*)p;return cudaSuccess;}
// Kernels: launched into nothing, and counted (with memsets, device-to-device copies and graph
// launches): pretend_gpu.py reads the count, what a GPU would have run as separate operations.
static unsigned long long n_ops;
unsigned long long pretend_gpu_runtime_ops(void){return __atomic_load_n(&n_ops, __ATOMIC_RELAXED);}
static cudaError_t op(void){__atomic_add_fetch(&n_ops, 1, __ATOMIC_RELAXED); return cudaSuccess;}
cudaError_t cudaLaunchKernel(const void* f, dim3 g, dim3 b, void** a, size_t s, cudaStream_t st){return op();}
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* c, const void* f, void** a){return op();}
// What nvcc's launch stubs call in CUDA 13 (ATen's own kernels come through here).
cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 g, dim3 b, void** a, size_t s, cudaStream_t st){return op();}
cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t k, dim3 g, dim3 b, void** a, size_t s, cudaStream_t st){return op();}
cudaError_t cudaLaunchCooperativeKernel(const void* f, dim3 g, dim3 b, void** a, size_t s, cudaStream_t st){return op();}
cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes* a, const void* f){memset(a,0,sizeof(*a));a->maxThreadsPerBlock=1024;a->numRegs=32;a->ptxVersion=90;a->binaryVersion=90;return cudaSuccess;}
cudaError_t cudaFuncSetAttribute(const void* f, enum cudaFuncAttribute a, int v){return cudaSuccess;}
cudaError_t cudaFuncSetCacheConfig(const void* f, enum cudaFuncCache c){return cudaSuccess;}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void* f, int b, size_t s){*n=2;return cudaSuccess;}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, const void* f, int b, size_t s, unsigned fl){*n=2;return cudaSuccess;}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b){*ms=1.0f;return cudaSuccess;}
cudaError_t cudaStreamCreate(cudaStream_t* s){return cudaStreamCreateWithPriority(s,0,0);}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned f){return cudaStreamCreateWithPriority(s,f,0);}
cudaError_t cudaStreamDestroy(cudaStream_t s){return cudaSuccess;}
cudaError_t cudaStreamGetPriority(cudaStream_t s, int* p){*p=0;return cudaSuccess;}
cudaError_t cudaStreamGetFlags(cudaStream_t s, unsigned* f){*f=0;return cudaSuccess;}
cudaError_t cudaDeviceGetLimit(size_t* v, enum cudaLimit l){*v=1024;return cudaSuccess;}
cudaError_t cudaDeviceSetLimit(enum cudaLimit l, size_t v){return cudaSuccess;}
cudaError_t cudaDeviceEnablePeerAccess(int d, unsigned f){return cudaSuccess;}
cudaError_t cudaSetDeviceFlags(unsigned f){return cudaSuccess;}
cudaError_t cudaGetDeviceFlags(unsigned* f){*f=0;return cudaSuccess;}
cudaError_t cudaInitDevice(int d, unsigned a, unsigned b){return cudaSuccess;}
// CUDA graphs (mode="reduce-overhead"): a stream being captured says so, with its capture id, so torch's
// allocator and RNG take their capture paths; graphs are handles to nothing and replays do nothing.
#define MAXC 64
static cudaStream_t cstream[MAXC]; static unsigned long long cid[MAXC]; static unsigned long long next_cid = 1;
static pthread_mutex_t cmu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long capture_id(cudaStream_t s){
  unsigned long long id = 0;
  pthread_mutex_lock(&cmu);
  for(int i=0;i<MAXC;i++) if(cid[i] && cstream[i]==s){id=cid[i]; break;}
  pthread_mutex_unlock(&cmu);
  return id;}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode m){
  cudaError_t r = cudaErrorIllegalState;
  pthread_mutex_lock(&cmu);
  for(int i=0;i<MAXC;i++) if(!cid[i]){cstream[i]=s; cid[i]=next_cid++; r=cudaSuccess; break;}
  pthread_mutex_unlock(&cmu);
  return r;}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g){
  pthread_mutex_lock(&cmu);
  for(int i=0;i<MAXC;i++) if(cid[i] && cstream[i]==s){cid[i]=0; break;}
  pthread_mutex_unlock(&cmu);
  *g=(cudaGraph_t)malloc(64); return cudaSuccess;}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus* st){
  *st = capture_id(s) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone; return cudaSuccess;}
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, enum cudaStreamCaptureStatus* st, unsigned long long* id, cudaGraph_t* g, const cudaGraphNode_t** d, const cudaGraphEdgeData** e, size_t* n){
  unsigned long long c = capture_id(s);
  *st = c ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  if(id)*id=c; if(g)*g=0; if(d)*d=0; if(e)*e=0; if(n)*n=0; return cudaSuccess;}
// One node per graph: torch warns about an empty capture, and this one is not empty, only pretend.
cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t* nodes, size_t* n){
  if(nodes && *n) nodes[0]=(cudaGraphNode_t)g; *n=1; return cudaSuccess;}
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* x, cudaGraph_t g, unsigned long long f){*x=(cudaGraphExec_t)malloc(64);return cudaSuccess;}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* x, cudaGraph_t g, unsigned long long f){return cudaGraphInstantiateWithFlags(x,g,f);}
cudaError_t cudaGraphUpload(cudaGraphExec_t x, cudaStream_t s){return cudaSuccess;}
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s){return op();}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x){free(x);return cudaSuccess;}
cudaError_t cudaGraphDestroy(cudaGraph_t g){free(g);return cudaSuccess;}
cudaError_t cudaGraphDebugDotPrint(cudaGraph_t g, const char* path, unsigned f){return cudaSuccess;}
