# Runs this machine's task of an od-dist cluster: the same script on every Windows machine.
#
#   powershell -ExecutionPolicy Bypass -File scripts\od-dist-node.ps1 [ROLE [INDEX]] [more od-dist train flags]
#
#   $env:OD_DIST_PIPELINE = 'pipelines/shapes_retinanet.yaml'; $env:OD_DIST_MODEL_DIR = 'runs/lan'
#   scripts\od-dist-node.ps1 master
#   scripts\od-dist-node.ps1 worker 1 --pipeline=pipelines/shapes_retinanet.yaml --model_dir=runs/lan
#   scripts\od-dist-node.ps1            # role and index found from this machine's own address
#
# ROLE is ps, master (or chief), worker or evaluator; INDEX defaults to 0. Environment:
#   OD_DIST_CLUSTER    the cluster file (default clusters/lan.yaml, as in the README), same on
#                      every machine
#   OD_DIST_PIPELINE   passed as --pipeline     (or give --pipeline=... after ROLE INDEX)
#   OD_DIST_MODEL_DIR  passed as --model_dir    (or give --model_dir=...); values with spaces or
#                      quotes are easiest to pass this way
#   OD_DIST_WORKDIR    where to run (default: the checkout this script is in); relative paths
#                      above are resolved there
#   OD_DIST_VENV       a virtual environment to run od-dist from (default: <workdir>\.venv if it
#                      has od-dist.exe, else od-dist.exe on PATH)
#   OD_DIST_PYTHON     run `<python> -m od_dist` instead
# The task runs under od-dist's supervisor with --max_restarts=3 (the generated scripts' default,
# LAUNCH_MAX_RESTARTS in od_dist/cli/flags.py): a lost task is restarted, as there; a
# --max_restarts among the flags wins. The order in which machines start does not matter: every
# task waits for its peers (--wait_timeout). See scripts/README.md.
#
# Windows PowerShell 5.1 and PowerShell 7.x alike: the command line is built here by the
# C-runtime rules that od-dist.exe (Python) splits it with, and handed to the process as is, so
# PowerShell's own native-argument passing (which drops embedded quotes in 5.1 and changed in
# 7.3) plays no part.
$ErrorActionPreference = 'Stop'

function ConvertTo-WindowsArgument([string]$Value) {
    # Quoted when empty or holding whitespace or a quote; backslashes doubled only before a quote.
    # The same rules as windows_arg() in od_dist/render/quote.py.
    if ($Value.Length -gt 0 -and $Value -notmatch '[\s"]') { return $Value }
    $out = New-Object System.Text.StringBuilder
    [void]$out.Append('"')
    $backslashes = 0
    foreach ($c in $Value.ToCharArray()) {
        if ($c -eq [char]'\') { $backslashes++; continue }
        if ($c -eq [char]'"') { [void]$out.Append('\' * (2 * $backslashes + 1)) }
        else { [void]$out.Append('\' * $backslashes) }
        [void]$out.Append($c)
        $backslashes = 0
    }
    [void]$out.Append('\' * (2 * $backslashes))
    [void]$out.Append('"')
    return $out.ToString()
}

$rest = @($args)
if ($env:OD_DIST_WORKDIR) { $workdir = $env:OD_DIST_WORKDIR } else { $workdir = Join-Path $PSScriptRoot '..' }
Set-Location -LiteralPath $workdir
if ($env:OD_DIST_CLUSTER) { $cluster = $env:OD_DIST_CLUSTER } else { $cluster = 'clusters/lan.yaml' }

$argv = New-Object System.Collections.Generic.List[string]
$argv.Add('train')
$argv.Add("--cluster=$cluster")
$i = 0
if ($rest.Count -gt $i -and -not ([string]$rest[$i]).StartsWith('-')) {
    $argv.Add("--role=$($rest[$i])")
    $i++
    if ($rest.Count -gt $i -and [string]$rest[$i] -match '^[0-9]+$') {
        $argv.Add("--index=$($rest[$i])")
        $i++
    }
}
if ($env:OD_DIST_PIPELINE) { $argv.Add("--pipeline=$env:OD_DIST_PIPELINE") }
if ($env:OD_DIST_MODEL_DIR) { $argv.Add("--model_dir=$env:OD_DIST_MODEL_DIR") }
# Before the caller's flags: absl takes the last of a flag given twice.
$argv.Add('--max_restarts=3')
for (; $i -lt $rest.Count; $i++) { $argv.Add([string]$rest[$i]) }

$prefix = @()
if ($env:OD_DIST_PYTHON) {
    $exe = $env:OD_DIST_PYTHON
    $prefix = @('-m', 'od_dist')
} else {
    $venv = $env:OD_DIST_VENV
    if (-not $venv -and (Test-Path -LiteralPath '.venv\Scripts\od-dist.exe')) {
        $venv = [System.IO.Path]::Combine($PWD.ProviderPath, '.venv')
    }
    if ($venv) {
        # What the venv's Activate.ps1 does, without needing it to be allowed to run.
        $env:VIRTUAL_ENV = $venv
        $env:PATH = [System.IO.Path]::Combine($venv, 'Scripts') + ';' + $env:PATH
        Remove-Item -Path Env:PYTHONHOME -ErrorAction SilentlyContinue
        $exe = [System.IO.Path]::Combine($venv, 'Scripts\od-dist.exe')
    } else {
        $exe = 'od-dist'
    }
}
if ($exe -match '[\\/:]') {
    $exe = [System.IO.Path]::Combine($PWD.ProviderPath, $exe)
} else {
    $exe = (Get-Command -Name $exe -CommandType Application -ErrorAction Stop | Select-Object -First 1).Path
}
if ([System.IO.Path]::GetExtension($exe) -ne '.exe') {
    throw "$exe is not an .exe: a .cmd/.bat would parse the arguments again; use od-dist.exe or python.exe"
}

$start = New-Object System.Diagnostics.ProcessStartInfo
$start.FileName = $exe
$start.Arguments = ((@($prefix) + @($argv)) | ForEach-Object { ConvertTo-WindowsArgument $_ }) -join ' '
# Set-Location does not move the process's own directory: pass it on explicitly.
$start.WorkingDirectory = $PWD.ProviderPath
$start.UseShellExecute = $false
$process = [System.Diagnostics.Process]::Start($start)
$process.WaitForExit()
exit $process.ExitCode
